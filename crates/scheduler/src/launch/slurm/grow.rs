//! Growing a running Slurm cluster by one more job, and giving such a job back (see the
//! parent module's docs).

use std::path::PathBuf;

use tokio::net::TcpStream;

use super::super::report::{open_reports, routable_ip};
use super::super::{Grown, LaunchError, LaunchRequest};
use super::{SlurmLauncher, Target, cancel, watch_job};

/// One job [`HostLauncher::grow`] submitted: what releasing it stops.
#[derive(Default)]
pub(super) struct Added {
    pub(super) output: PathBuf,
    pub(super) links: Vec<TcpStream>,
    pub(super) watcher: Option<tokio::task::JoinHandle<()>>,
}

impl SlurmLauncher {
    /// [`HostLauncher::grow`]: submits one more job, its hosts numbered from `base` and
    /// reporting to a rendezvous of their own; on failure it is cancelled again.
    pub(super) async fn grow_job(
        &self,
        req: &LaunchRequest,
        base: usize,
    ) -> Result<Grown, LaunchError> {
        let ip = self.opts.report_ip.unwrap_or_else(routable_ip);
        let (report_to, rx, accept) = open_reports(ip, req, "Slurm").await?;
        let submitted = self.sbatch(req, &report_to, base).await;
        let (job, output) = match submitted {
            Ok(x) => x,
            Err(e) => {
                accept.abort();
                return Err(e);
            }
        };
        // Recorded at once: a teardown while its hosts come up cancels it too.
        self.set(|s| {
            s.added.insert(
                job.clone(),
                Added {
                    output: output.clone(),
                    ..Added::default()
                },
            )
        });
        let t = Target {
            job: Some(job.clone()),
            output: Some(output.clone()),
            base,
        };
        let waited = self.wait_reports(req, rx, &t).await;
        accept.abort();
        match waited {
            Ok((hosts, links)) => {
                let watcher = watch_job(job.clone(), Some(output));
                let kept = self.set(|s| match s.added.get_mut(&job) {
                    Some(a) => {
                        a.links = links;
                        a.watcher = Some(watcher);
                        true
                    }
                    None => false, // torn down meanwhile
                });
                if kept != Some(true) {
                    return Err(LaunchError::Ended {
                        what: t.what(),
                        detail: "the launcher was torn down while its hosts came up".into(),
                    });
                }
                Ok(Grown { id: job, hosts })
            }
            Err(e) => {
                if let Some(a) = self.set(|s| s.added.remove(&job)).flatten() {
                    release_added(job, a).await;
                }
                Err(e)
            }
        }
    }
}

/// Gives an added job back: no more "ended under its hosts" report, its hosts' links closed
/// (they start stopping their actors), then `scancel`.
pub(super) async fn release_added(job: String, a: Added) {
    if let Some(w) = a.watcher {
        w.abort();
    }
    drop(a.links);
    cancel(&job).await;
}
