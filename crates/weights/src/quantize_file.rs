//! Offline conversion of a BF16 / F32 safetensors checkpoint to FP8 (`troupe quantize`).
//!
//! Users convert checkpoints once for FP8 serving. Every tensor [`should_quantize`] selects is
//! written as `float8_e4m3fn` followed by its scale (`...weight_scale_inv`, or `...weight_scale`
//! per tensor); everything else, and the `__metadata__` map, is copied unchanged, in the input's
//! order. The input is streamed one tensor at a time, so memory stays at about one tensor, not one
//! checkpoint. The output is written to a temporary file in the destination directory and renamed
//! into place only when complete: a malformed or truncated input, a non-finite weight or a full
//! disk leaves no output behind (and an existing output untouched).

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::Dtype;
use safetensors::tensor::Metadata;

use crate::fp8::{self, Fp8Error, Fp8Options, ScaleDtype, Weights, should_quantize};

/// Largest header the safetensors format allows.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Why a checkpoint could not be converted. Every variant names the file (and tensor).
#[derive(Debug, thiserror::Error)]
pub enum QuantizeFileError {
    /// The input could not be opened or read.
    #[error("cannot read `{path}`: {source}")]
    Read {
        /// The input file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The input is not a regular file (a FIFO would block forever, a device never end).
    #[error("input `{path}` is {kind}, not a regular file; give a .safetensors file")]
    InputNotRegular {
        /// The input path as given.
        path: PathBuf,
        /// What it is ("a FIFO", "a character device", ...).
        kind: &'static str,
    },
    /// The input is not a well-formed safetensors file.
    #[error(
        "`{path}` is not a valid safetensors file: {reason}; re-download or re-export the \
         checkpoint (is it truncated?)"
    )]
    Malformed {
        /// The input file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A selected weight is in a dtype the codec does not take.
    #[error(
        "tensor `{tensor}` in `{path}` is {dtype}; FP8 quantization takes BF16 or F32 weights \
         (convert the checkpoint to bf16 first{hint})"
    )]
    UnsupportedDtype {
        /// The input file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: String,
        /// Extra advice (e.g. for an already-quantized checkpoint).
        hint: &'static str,
    },
    /// The scale name of a weight to quantize is already taken in the input.
    #[error(
        "`{path}` already holds `{scale}`, the scale name for `{tensor}`; the checkpoint looks \
         already quantized"
    )]
    NameCollision {
        /// The input file.
        path: PathBuf,
        /// The weight to quantize.
        tensor: String,
        /// Its scale name.
        scale: String,
    },
    /// Input and output name the same file: the input would be replaced while being read.
    #[error("input and output are the same file `{path}`; write the FP8 checkpoint elsewhere")]
    SamePath {
        /// The file.
        path: PathBuf,
    },
    /// The output path exists and is not a regular file (a device, FIFO, symlink, directory):
    /// renaming the result over it would replace that object.
    #[error(
        "output `{path}` exists and is {kind}, not a regular file; name a new file or a regular \
         file to replace"
    )]
    OutputNotRegular {
        /// The output path as given.
        path: PathBuf,
        /// What it is ("a symlink", "a character device", ...).
        kind: &'static str,
    },
    /// Quantizing a tensor failed (non-finite values, ...).
    #[error("in `{path}`: {source}")]
    Quantize {
        /// The input file.
        path: PathBuf,
        /// The codec error, naming the tensor.
        source: Fp8Error,
    },
    /// The output could not be written.
    #[error("cannot write `{path}`: {source}")]
    Write {
        /// The output (or its temporary) file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
}

/// What a conversion did, for the CLI summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizeSummary {
    /// Tensors in the input.
    pub tensors: usize,
    /// Weights written as FP8 (each with one scale tensor).
    pub quantized: usize,
    /// Tensors copied unchanged.
    pub copied: usize,
    /// Size of the input file.
    pub bytes_before: u64,
    /// Size of the output file.
    pub bytes_after: u64,
    /// How the weights were quantized.
    pub options: Fp8Options,
}

impl std::fmt::Display for QuantizeSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "quantized {} of {} tensors to float8_e4m3fn ({}), copied {} unchanged; {} -> {}",
            self.quantized,
            self.tensors,
            self.options.granularity,
            self.copied,
            human_bytes(self.bytes_before),
            human_bytes(self.bytes_after),
        )
    }
}

/// `1.50 GiB`-style sizes for the summary line.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// Progress of a conversion: input tensor bytes processed so far, out of the total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Input tensor bytes done.
    pub done_bytes: u64,
    /// Input tensor bytes in all.
    pub total_bytes: u64,
}

/// Converts the safetensors file `input` into an FP8 checkpoint at `output`.
pub fn quantize_file(
    input: &Path,
    output: &Path,
    opts: &Fp8Options,
) -> Result<QuantizeSummary, QuantizeFileError> {
    quantize_file_with_progress(input, output, opts, &mut |_| {})
}

/// [`quantize_file`], reporting progress after every tensor (the CLI drives a progress bar).
pub fn quantize_file_with_progress(
    input: &Path,
    output: &Path,
    opts: &Fp8Options,
    progress: &mut dyn FnMut(Progress),
) -> Result<QuantizeSummary, QuantizeFileError> {
    let read_err = |source| QuantizeFileError::Read {
        path: input.to_path_buf(),
        source,
    };
    check_output(output)?;
    let file = open_input(input)?;
    let bytes_before = file.metadata().map_err(read_err)?.len();
    if let (Ok(a), Ok(b)) = (fs::canonicalize(input), fs::canonicalize(output))
        && a == b
    {
        return Err(QuantizeFileError::SamePath { path: a });
    }
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let (metadata, names) = read_header(input, &mut reader, bytes_before)?;
    let plan = plan_output(input, &metadata, &names, opts)?;
    let header = output_header(&metadata, &plan, opts);

    let temp = TempFile::create(output)?;
    let write_err = |path: &Path, source| QuantizeFileError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut writer = BufWriter::with_capacity(1 << 20, &temp.file);
    writer
        .write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| writer.write_all(header.as_bytes()))
        .map_err(|e| write_err(&temp.path, e))?;

    let total_bytes = metadata.data_len() as u64;
    let mut done_bytes = 0u64;
    let mut buf = Vec::new();
    let mut quantized = 0;
    for entry in &plan {
        buf.resize(entry.input_bytes, 0);
        reader
            .read_exact(&mut buf)
            .map_err(|e| QuantizeFileError::Malformed {
                path: input.to_path_buf(),
                reason: format!("reading tensor `{}` failed: {e}", entry.name),
            })?;
        match &entry.action {
            Action::Copy => writer.write_all(&buf),
            Action::Quantize { rows, cols, .. } => {
                let q = quantize_bytes(&entry.name, *rows, *cols, entry.dtype, &buf, opts)
                    .map_err(|source| QuantizeFileError::Quantize {
                        path: input.to_path_buf(),
                        source,
                    })?;
                quantized += 1;
                writer
                    .write_all(&q.data)
                    .and_then(|()| writer.write_all(&q.scales.to_le_bytes()))
            }
        }
        .map_err(|e| write_err(&temp.path, e))?;
        done_bytes += entry.input_bytes as u64;
        progress(Progress {
            done_bytes,
            total_bytes,
        });
    }
    writer.flush().map_err(|e| write_err(&temp.path, e))?;
    drop(writer);
    temp.file.sync_all().map_err(|e| write_err(&temp.path, e))?;
    let bytes_after = temp
        .file
        .metadata()
        .map_err(|e| write_err(&temp.path, e))?
        .len();
    // Checked again right before the rename: the output may have been replaced meanwhile.
    check_output(output)?;
    temp.persist(output)?;

    let summary = QuantizeSummary {
        tensors: plan.len(),
        quantized,
        copied: plan.len() - quantized,
        bytes_before,
        bytes_after,
        options: *opts,
    };
    tracing::info!(input = %input.display(), output = %output.display(), "{summary}");
    Ok(summary)
}

/// Reads and validates the header; returns it with the tensor names in file (offset) order.
fn read_header(
    path: &Path,
    reader: &mut impl Read,
    file_len: u64,
) -> Result<(Metadata, Vec<String>), QuantizeFileError> {
    let malformed = |reason: String| QuantizeFileError::Malformed {
        path: path.to_path_buf(),
        reason,
    };
    let mut len = [0u8; 8];
    reader.read_exact(&mut len).map_err(|_| {
        malformed(format!(
            "only {file_len} bytes, shorter than the 8-byte header length"
        ))
    })?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES || n > file_len.saturating_sub(8) {
        return Err(malformed(format!(
            "header length {n} does not fit in a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; n as usize];
    reader
        .read_exact(&mut header)
        .map_err(|e| malformed(format!("reading the header failed: {e}")))?;
    let text =
        std::str::from_utf8(&header).map_err(|e| malformed(format!("header is not UTF-8: {e}")))?;
    let metadata: Metadata =
        serde_json::from_str(text).map_err(|e| malformed(format!("bad header: {e}")))?;
    let expected = 8 + n + metadata.data_len() as u64;
    if expected != file_len {
        return Err(malformed(format!(
            "the header describes {expected} bytes but the file has {file_len}"
        )));
    }
    let names = metadata.offset_keys();
    Ok((metadata, names))
}

/// What happens to one input tensor.
enum Action {
    /// Written unchanged.
    Copy,
    /// Written as FP8, followed by its scale tensor.
    Quantize {
        rows: usize,
        cols: usize,
        scale_name: String,
        scale_shape: Vec<usize>,
    },
}

/// One input tensor and its fate.
struct Entry {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    input_bytes: usize,
    action: Action,
}

/// Decides every tensor's fate up front, so all input errors surface before any byte is written.
fn plan_output(
    path: &Path,
    metadata: &Metadata,
    names: &[String],
    opts: &Fp8Options,
) -> Result<Vec<Entry>, QuantizeFileError> {
    let mut plan = Vec::with_capacity(names.len());
    for name in names {
        let Some(info) = metadata.info(name) else {
            continue;
        };
        let (start, end) = info.data_offsets;
        let mut entry = Entry {
            name: name.clone(),
            dtype: info.dtype,
            shape: info.shape.clone(),
            input_bytes: end - start,
            action: Action::Copy,
        };
        if should_quantize(name, &info.shape) {
            if !matches!(info.dtype, Dtype::BF16 | Dtype::F32) {
                let hint = if matches!(info.dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2) {
                    "; this checkpoint looks already quantized"
                } else {
                    ""
                };
                return Err(QuantizeFileError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    dtype: info.dtype.to_string(),
                    hint,
                });
            }
            let scale_name = fp8::scale_name(name, opts.granularity).map_err(|source| {
                QuantizeFileError::Quantize {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
            if metadata.info(&scale_name).is_some() {
                return Err(QuantizeFileError::NameCollision {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    scale: scale_name,
                });
            }
            let (rows, cols) = (info.shape[0], info.shape[1]);
            entry.action = Action::Quantize {
                rows,
                cols,
                scale_shape: opts.granularity.scale_shape(rows, cols),
                scale_name,
            };
        }
        plan.push(entry);
    }
    Ok(plan)
}

/// The output header: tensors in plan order (scales right after their weights), the input's
/// `__metadata__` unchanged, padded with spaces to a multiple of 8 bytes as the format asks.
fn output_header(metadata: &Metadata, plan: &[Entry], opts: &Fp8Options) -> String {
    let json = |s: &str| serde_json::Value::from(s).to_string();
    let (scale_dtype, scale_size) = match opts.scale_dtype {
        ScaleDtype::F32 => (Dtype::F32, 4),
        ScaleDtype::Bf16 => (Dtype::BF16, 2),
    };
    let mut fields = Vec::with_capacity(plan.len() * 2 + 1);
    if let Some(meta) = metadata.metadata() {
        let mut keys: Vec<&String> = meta.keys().collect();
        keys.sort();
        let inner: Vec<String> = keys
            .into_iter()
            .map(|k| format!("{}:{}", json(k), json(&meta[k])))
            .collect();
        fields.push(format!("\"__metadata__\":{{{}}}", inner.join(",")));
    }
    let mut offset = 0usize;
    let mut push = |name: &str, dtype: Dtype, shape: &[usize], bytes: usize| {
        let shape: Vec<String> = shape.iter().map(usize::to_string).collect();
        fields.push(format!(
            "{}:{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{offset},{}]}}",
            json(name),
            shape.join(","),
            offset + bytes
        ));
        offset += bytes;
    };
    for e in plan {
        match &e.action {
            Action::Copy => push(&e.name, e.dtype, &e.shape, e.input_bytes),
            Action::Quantize {
                rows,
                cols,
                scale_name,
                scale_shape,
            } => {
                push(&e.name, Dtype::F8_E4M3, &e.shape, rows * cols);
                let count: usize = scale_shape.iter().product();
                push(scale_name, scale_dtype, scale_shape, count * scale_size);
            }
        }
    }
    let mut header = format!("{{{}}}", fields.join(","));
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    header
}

/// Quantizes one tensor's little-endian bytes.
fn quantize_bytes(
    name: &str,
    rows: usize,
    cols: usize,
    dtype: Dtype,
    bytes: &[u8],
    opts: &Fp8Options,
) -> Result<fp8::QuantizedTensor, Fp8Error> {
    match dtype {
        Dtype::BF16 => {
            let v: Vec<bf16> = bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect();
            fp8::quantize(name, rows, cols, Weights::Bf16(&v), opts)
        }
        _ => {
            let v: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            fp8::quantize(name, rows, cols, Weights::F32(&v), opts)
        }
    }
}

/// Opens the input without blocking (a FIFO would wait for a writer) and refuses anything but a
/// regular file, checked on the opened file; a symlink is followed (model caches are made of them).
fn open_input(input: &Path) -> Result<File, QuantizeFileError> {
    let read_err = |source| QuantizeFileError::Read {
        path: input.to_path_buf(),
        source,
    };
    let mut open = OpenOptions::new();
    open.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut open, libc::O_NONBLOCK);
    let file = open.open(input).map_err(read_err)?;
    let t = file.metadata().map_err(read_err)?.file_type();
    if !t.is_file() {
        return Err(QuantizeFileError::InputNotRegular {
            path: input.to_path_buf(),
            kind: file_kind(&t),
        });
    }
    Ok(file)
}

/// Refuses an output that exists and is not a regular file. `symlink_metadata` does not follow a
/// symlink, so a link is refused as itself (the rename would replace the link, never write
/// through it, but a user naming a link almost always means its target).
fn check_output(output: &Path) -> Result<(), QuantizeFileError> {
    let meta = match fs::symlink_metadata(output) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(QuantizeFileError::Write {
                path: output.to_path_buf(),
                source,
            });
        }
    };
    let kind = file_kind(&meta.file_type());
    if kind == "a regular file" {
        Ok(())
    } else {
        Err(QuantizeFileError::OutputNotRegular {
            path: output.to_path_buf(),
            kind,
        })
    }
}

/// Names a file type for an error message.
fn file_kind(t: &fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_symlink() {
        "a symlink"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// A temporary output next to the destination, removed on drop unless persisted.
struct TempFile {
    path: PathBuf,
    file: File,
    keep: bool,
}

impl TempFile {
    fn create(output: &Path) -> Result<Self, QuantizeFileError> {
        let file_name = output
            .file_name()
            .map_or_else(|| "output".into(), |n| n.to_string_lossy().into_owned());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path =
            output.with_file_name(format!(".{file_name}.tmp-{}-{nanos}", std::process::id()));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|source| QuantizeFileError::Write {
                path: path.clone(),
                source,
            })?;
        Ok(TempFile {
            path,
            file,
            keep: false,
        })
    }

    fn persist(mut self, output: &Path) -> Result<(), QuantizeFileError> {
        fs::rename(&self.path, output).map_err(|source| QuantizeFileError::Write {
            path: output.to_path_buf(),
            source,
        })?;
        self.keep = true;
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_file(&self.path);
        }
    }
}
