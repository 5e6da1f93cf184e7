fn main() {
    let a: Vec<String> = std::env::args().collect();
    let s = troupe_weights::quantize_file::quantize_file(a[1].as_ref(), a[2].as_ref(), &Default::default()).unwrap();
    println!("{s}");
}
