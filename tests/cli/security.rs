//! Control-plane security: the controller API's token, refusing unguarded non-loopback
//! listeners, and TLS (rustls) on host and controller gRPC, with certificates made by rcgen.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::within;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tokio::io::{AsyncBufReadExt, BufReader};
use troupe_actors::builtin::diag::{Diag, DiagArgs, Info};
use troupe_actors::tls::{ClientTls, ServerTls, TlsFiles};
use troupe_controller::Cluster;
use troupe_controller::api::{self, ControllerApi};
use troupe_controller::cluster::InProcessTransport;
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_weights::tcp::WeightSender;
use troupe_wire::v1::{
    BeginWeightUpdateRequest, EndWeightUpdateRequest, GetWeightPlanRequest, InitWeightGroupRequest,
    WeightBucketRequest,
};

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

/// A CA and a server certificate it signed (for 127.0.0.1 and localhost), as PEM files.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} test CA"));
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("cert.pem"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("key.pem"), key.serialize_pem()).unwrap();
        Pki { dir }
    }

    fn path(&self, f: &str) -> PathBuf {
        self.dir.path().join(f)
    }

    fn files(&self) -> TlsFiles {
        TlsFiles {
            cert: Some(self.path("cert.pem")),
            key: Some(self.path("key.pem")),
            ca: Some(self.path("ca.pem")),
        }
    }

    /// Trusts this CA only.
    fn trust_only(&self) -> TlsFiles {
        TlsFiles {
            ca: Some(self.path("ca.pem")),
            ..TlsFiles::default()
        }
    }

    fn client(&self) -> ClientTls {
        ClientTls::load(&self.path("ca.pem")).unwrap()
    }

    fn server(&self) -> ServerTls {
        ServerTls::load(&self.path("cert.pem"), &self.path("key.pem")).unwrap()
    }
}

/// One regular reference engine behind the gateway, on an in-process host.
async fn one_engine() -> (Cluster, Deployment) {
    common::pd_deployment(1, 1, "troupe:d1", &ForkOptions::default()).await
}

async fn is_unauthenticated<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) {
    match r {
        Err(s) => assert_eq!(s.code(), tonic::Code::Unauthenticated, "{s:?}"),
        Ok(v) => panic!("an unauthenticated call was served: {v:?}"),
    }
}

#[tokio::test]
async fn the_controller_api_refuses_calls_without_the_token_and_they_change_nothing() {
    within(120, async {
        let (cluster, svc) = one_engine().await;
        let server = ControllerApi::new(svc.plane.clone())
            .with_token(Some("api-s3cret".into()))
            .spawn("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = server.addr().to_string();
        // A trainer's broadcast master that engines would join if an init went through.
        let mut master = WeightSender::bind("127.0.0.1:0", 2, "g").await.unwrap();
        let port = master.local_addr().unwrap().port() as u32;
        let key = master.secret();
        let init = || InitWeightGroupRequest {
            master_address: "127.0.0.1".into(),
            master_port: port,
            group_name: "g".into(),
            backend: "tcp".into(),
            group_secret: key.clone(),
        };
        for token in [None, Some("wrong")] {
            let mut c = api::connect(&addr, token, None, Duration::from_secs(10))
                .await
                .unwrap();
            is_unauthenticated(c.get_weight_plan(GetWeightPlanRequest {}).await).await;
            is_unauthenticated(c.init_weight_group(init()).await).await;
            is_unauthenticated(
                c.begin_weight_update(BeginWeightUpdateRequest {
                    pause_mode: "abort".into(),
                })
                .await,
            )
            .await;
            is_unauthenticated(
                c.weight_bucket(WeightBucketRequest {
                    group_name: "g".into(),
                    names: vec!["x".into()],
                    dtypes: vec!["bfloat16".into()],
                    shapes: vec![Default::default()],
                    ..Default::default()
                })
                .await,
            )
            .await;
            is_unauthenticated(c.end_weight_update(EndWeightUpdateRequest::default()).await).await;
        }
        // Nothing changed: no engine joined the master, none is paused, no group exists.
        assert!(
            master.accept_all(Duration::from_millis(500)).await.is_err(),
            "an engine joined the weight group after a refused InitWeightGroup"
        );
        for r in svc.control.server_info().await {
            let v = r.result.unwrap();
            assert!(v["internal_states"][0]["paused"].is_null(), "paused: {v}");
        }
        let engine = &svc.control.engines()[0];
        let gone = svc
            .control
            .client()
            .destroy_weight_group(engine, "g")
            .await
            .unwrap_err()
            .to_string();
        assert!(gone.contains("no weight-update group"), "{gone}");

        // With the token the same calls are served.
        let mut c = api::connect(&addr, Some("api-s3cret"), None, Duration::from_secs(10))
            .await
            .unwrap();
        let plan = c
            .get_weight_plan(GetWeightPlanRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(plan.world_size, 2);
        let mut master = WeightSender::bind("127.0.0.1:0", 2, "g").await.unwrap();
        let port = master.local_addr().unwrap().port() as u32;
        let (joined, accepted) = tokio::join!(
            c.init_weight_group(InitWeightGroupRequest {
                master_port: port,
                group_secret: master.secret(),
                ..init()
            }),
            master.accept_all(Duration::from_secs(30))
        );
        assert!(joined.unwrap().into_inner().ok);
        accepted.unwrap();
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn the_controller_api_refuses_a_non_loopback_address_without_a_token() {
    within(60, async {
        let (cluster, svc) = one_engine().await;
        let api = ControllerApi::new(svc.plane.clone());
        let e = api
            .clone()
            .spawn("0.0.0.0:0".parse().unwrap())
            .await
            .unwrap_err();
        assert!(e.contains("token"), "{e}");
        // With a token it serves there.
        api.with_token(Some("t".into()))
            .spawn("0.0.0.0:0".parse().unwrap())
            .await
            .unwrap();
        svc.teardown().await;
        cluster.shutdown().await;

        // `troupe serve` refuses before it starts anything.
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("c.yaml");
        std::fs::write(&cfg, "allocation_mode: 'troupe:d1'\n").unwrap();
        let out = tokio::process::Command::new(BIN)
            .arg("serve")
            .arg(&cfg)
            .args(["--api-listen", "0.0.0.0:0"])
            .env_remove("TROUPE_TOKEN")
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("without a control-plane token"), "{err}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("gateway:"));
    })
    .await
}

#[tokio::test]
async fn a_tls_host_serves_clients_that_trust_its_ca_and_no_others() {
    within(60, async {
        let pki = Pki::new("a");
        let other = Pki::new("b");
        let c = Cluster::builder()
            .binary(BIN)
            .token(None)
            .tls(pki.files())
            .local_processes(1, 0)
            .await
            .unwrap();
        let a = c.host(0).spawn::<Diag>("d", &DiagArgs {}).await.unwrap();
        a.call(Info).await.unwrap();
        let addr = c.host(0).address().to_string();
        // Framed calls carry no TLS: a TLS host takes calls over gRPC only.
        assert!(!c.host(0).describe().await.unwrap().framed_calls);
        let plain = std::net::TcpStream::connect(&addr).unwrap();
        use std::io::{Read, Write};
        (&plain)
            .write_all(&troupe_actors::framed::hello(None))
            .unwrap();
        plain
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = [0u8; 64];
        let n = (&plain).read(&mut buf).unwrap_or(0);
        assert!(
            n == 0 || buf[0] == 0x15,
            "a TLS host answered a framed hello with something other than a TLS alert or EOF"
        );

        // Trusting the CA: reachable.
        let ok = Cluster::builder()
            .token(None)
            .tls(pki.trust_only())
            .connect(std::slice::from_ref(&addr))
            .await
            .unwrap();
        assert_eq!(ok.host(0).describe().await.unwrap().actors.len(), 1);
        ok.shutdown().await;
        // Plaintext, or trusting another CA: refused.
        for (what, files) in [
            ("plaintext", TlsFiles::default()),
            ("another CA", other.trust_only()),
        ] {
            let e = Cluster::builder()
                .token(None)
                .tls(files)
                .startup_timeout(Duration::from_secs(5))
                .connect(std::slice::from_ref(&addr))
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| panic!("a {what} client reached a TLS host"));
            assert!(e.contains("cannot connect"), "{what}: {e}");
            if what == "another CA" {
                assert!(e.to_lowercase().contains("certificate"), "{what}: {e}");
            }
        }
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn token_and_tls_together_on_hosts_and_in_process_grpc() {
    within(60, async {
        let pki = Pki::new("tt");
        let c = Cluster::builder()
            .transport(InProcessTransport::Grpc)
            .token(Some("both".into()))
            .tls(pki.files())
            .in_process(1, 0)
            .await
            .unwrap();
        let addr = c.host(0).address().to_string();
        for bad in [None, Some("wrong".to_string())] {
            let e = Cluster::builder()
                .token(bad.clone())
                .tls(pki.trust_only())
                .connect(std::slice::from_ref(&addr))
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("unauthenticated"), "{bad:?}: {e}");
        }
        let ok = Cluster::builder()
            .token(Some("both".into()))
            .tls(pki.trust_only())
            .connect(std::slice::from_ref(&addr))
            .await
            .unwrap();
        let a = ok.host(0).spawn::<Diag>("d", &DiagArgs {}).await.unwrap();
        a.call(Info).await.unwrap();
        ok.shutdown().await;
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn the_controller_api_over_tls_with_a_token() {
    within(120, async {
        let pki = Pki::new("api");
        let other = Pki::new("other");
        let (cluster, svc) = one_engine().await;
        let server = ControllerApi::new(svc.plane.clone())
            .with_token(Some("k".into()))
            .with_tls(Some(pki.server()))
            .spawn("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = server.addr().to_string();
        let t = Duration::from_secs(5);
        let mut c = api::connect(&addr, Some("k"), Some(&pki.client()), t)
            .await
            .unwrap();
        assert_eq!(
            c.get_weight_plan(GetWeightPlanRequest {})
                .await
                .unwrap()
                .into_inner()
                .world_size,
            2
        );
        let mut c = api::connect(&addr, Some("nope"), Some(&pki.client()), t)
            .await
            .unwrap();
        is_unauthenticated(c.get_weight_plan(GetWeightPlanRequest {}).await).await;
        assert!(
            api::connect(&addr, Some("k"), Some(&other.client()), t)
                .await
                .is_err(),
            "a client trusting another CA connected"
        );
        match api::connect(&addr, Some("k"), None, t).await {
            Err(_) => {}
            Ok(mut c) => assert!(
                c.get_weight_plan(GetWeightPlanRequest {}).await.is_err(),
                "a plaintext client was served by a TLS api"
            ),
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

async fn host_fails(args: &[&str]) -> String {
    let out = tokio::process::Command::new(BIN)
        .arg("host")
        .args(args)
        .env_remove("TROUPE_TLS_CERT")
        .env_remove("TROUPE_TLS_KEY")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "{args:?} started a host");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn bad_or_missing_tls_files_are_errors_naming_the_file() {
    within(30, async {
        let pki = Pki::new("f");
        let s = |p: &Path| p.display().to_string();
        let (cert, key) = (s(&pki.path("cert.pem")), s(&pki.path("key.pem")));
        let missing = s(&pki.path("nope.pem"));
        let junk = pki.path("junk.pem");
        std::fs::write(&junk, "not a certificate\n").unwrap();
        let junk = s(&junk);

        let e = host_fails(&["--tls-cert", &missing, "--tls-key", &key]).await;
        assert!(e.contains(&missing) && e.contains("cannot read"), "{e}");
        let e = host_fails(&["--tls-cert", &junk, "--tls-key", &key]).await;
        assert!(e.contains(&junk) && e.contains("no PEM certificate"), "{e}");
        let e = host_fails(&["--tls-cert", &cert, "--tls-key", &junk]).await;
        assert!(e.contains(&junk) && e.contains("private key"), "{e}");
        let e = host_fails(&["--tls-cert", &cert]).await;
        assert!(e.contains("without its key"), "{e}");

        // The controller side names the CA file.
        let e = Cluster::builder()
            .tls(TlsFiles {
                ca: Some(PathBuf::from(&missing)),
                ..TlsFiles::default()
            })
            .connect(&["127.0.0.1:1".to_string()])
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains(&missing) && e.contains("CA"), "{e}");
    })
    .await
}

/// A `troupe serve` process, stopped with SIGINT on drop (also when the test fails), so it tears
/// down the hosts it started; SIGKILL would leave them running.
struct Serve(Option<std::process::Child>);

impl Serve {
    /// SIGINT, then up to 20 s for a clean exit; the exit status if it came.
    fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.0.take()?;
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `troupe serve` with `token:` and `tls:` in its config: the hosts it starts and its API use
/// them (the config's token wins over `$TROUPE_TOKEN`).
#[tokio::test]
async fn troupe_serve_uses_the_config_token_and_tls_for_hosts_and_api() {
    within(120, async {
        let pki = Pki::new("serve");
        let cfg = pki.path("serve.yaml");
        let p = |f: &str| pki.path(f).display().to_string();
        std::fs::write(
            &cfg,
            format!(
                "allocation_mode: 'troupe:d1'\ncluster: {{n_nodes: 1, n_gpus_per_node: 1}}\nscheduler: {{type: local}}\nsglang: {{ready_timeout_s: 60}}\ntoken: from-config\ntls: {{cert: '{}', key: '{}', ca: '{}'}}\n",
                p("cert.pem"),
                p("key.pem"),
                p("ca.pem")
            ),
        )
        .unwrap();
        let mut child = std::process::Command::new(BIN)
            .arg("serve")
            .arg(&cfg)
            .args(["--api-listen", "127.0.0.1:0"])
            // Its own state file: never the working directory's, which another run may use.
            .arg("--state-file")
            .arg(pki.path("state.json"))
            .env("TROUPE_TOKEN", "from-env")
            .env_remove("TROUPE_TLS_CA")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = tokio::process::ChildStdout::from_std(child.stdout.take().unwrap()).unwrap();
        let mut serve = Serve(Some(child));
        let mut lines = BufReader::new(stdout).lines();
        let mut addr = None;
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(a) = l.strip_prefix("controller api: ") {
                addr = Some(a.trim().to_string());
                break;
            }
        }
        let addr = addr.expect("serve exited before printing the api address");
        let t = Duration::from_secs(5);
        let mut c = api::connect(&addr, Some("from-config"), Some(&pki.client()), t)
            .await
            .unwrap();
        let plan = c
            .get_weight_plan(GetWeightPlanRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(plan.world_size, 2);
        let mut c = api::connect(&addr, Some("from-env"), Some(&pki.client()), t)
            .await
            .unwrap();
        is_unauthenticated(c.get_weight_plan(GetWeightPlanRequest {}).await).await;

        let status = serve.stop().expect("serve did not exit within 20 s of SIGINT");
        assert!(status.success(), "{status}");
    })
    .await
}

/// `troupe serve` shows an admin key it generated (once, so the user can call the control
/// endpoints) but never one the user configured.
#[tokio::test]
async fn troupe_serve_never_prints_a_configured_admin_key() {
    use std::io::{BufRead, BufReader};
    within(120, async {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("serve.yaml");
        std::fs::write(
            &cfg,
            "allocation_mode: 'troupe:d1'\ncluster: {n_nodes: 1, n_gpus_per_node: 1}\nsglang: {ready_timeout_s: 60}\nadmin_key: k-Configured-9\n",
        )
        .unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
            .arg("serve")
            .arg(&cfg)
            .env_remove("TROUPE_ADMIN_KEY")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let mut serve = Serve(Some(child));
        // Every line is read to the end (a closed pipe would fail the shutdown's messages).
        let (up_tx, up_rx) = tokio::sync::oneshot::channel();
        let reader = tokio::task::spawn_blocking(move || {
            let mut seen = Vec::new();
            let mut up = Some(up_tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains("servers up")
                    && let Some(tx) = up.take()
                {
                    let _ = tx.send(());
                }
                seen.push(line);
            }
            seen
        });
        let _ = up_rx.await;
        assert!(serve.stop().is_some_and(|s| s.success()));
        let text = reader.await.unwrap().join("\n");
        assert!(text.contains("servers up"), "{text}");
        assert!(!text.contains("k-Configured-9"), "{text}");
        assert!(text.contains("admin key: configured"), "{text}");
    })
    .await
}
