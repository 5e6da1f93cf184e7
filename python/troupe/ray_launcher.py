"""Troupe's actor hosts on a Ray cluster: the Python half of `scheduler.type: ray`.

The controller (Rust, `crates/scheduler/src/launch/ray.rs`) runs this file as a script with
the configured interpreter (`scheduler.python`, one with `ray` installed), because Ray's API is
Python. It is self-contained on purpose: it imports nothing of the `troupe` package (whose
native extension the interpreter need not have), and the host actor class below travels to the
nodes by value (Ray pickles classes of `__main__`), so nodes need only `ray` and the `troupe`
binary.

Protocol with the controller:
- stdin, first line: the launch spec as JSON (address, namespace, strategy, hosts, resources,
  each host's argv, which environment variables to hand the hosts). The control-plane token
  is one of those variables: it reaches the hosts in their environment, never argv. stdin then
  stays open; end of file (the controller closing it, or dying) means shut down.
- stdout: one line per event, `troupe-ray {json}` (`placing`, `placed`, `started`, `error`,
  `exited`, `lost`, `done`). Anything else on stdout is not an event.
- Every host reports its own address to the controller's rendezvous (`troupe host --report-to`),
  exactly as under Slurm.

What it does: one placement group with one bundle per host (CPUs, GPUs and custom resources;
strategy STRICT_SPREAD by default). A group Ray finds infeasible is reported at once with
Ray's own scheduling state and what the cluster's nodes offer. On each bundle a small actor
starts `troupe host` as its child, with `CUDA_VISIBLE_DEVICES` from the GPUs Ray gave it; the
child dies with the actor (parent-death signal), so a killed actor or a lost node takes its
host with it and the controller sees the host go. On shutdown the hosts get SIGTERM, the actors
are killed and the placement group removed; if this process dies instead, Ray removes the
group and the actors itself (both belong to this driver's job).

From inside a Ray program (a verl- or SkyRL-style driver), `config_overrides()` gives the
`troupe.load_config` overrides that put a deployment on the driver's own cluster.
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Deque, Dict, List, Optional

#: Prefix of every event line on stdout.
EVENT = "troupe-ray "

#: Placement strategies Ray accepts for a placement group.
STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")


def emit(kind: str, **fields: Any) -> None:
    """Writes one event line for the controller."""
    fields["event"] = kind
    if kind in ("error", "exited", "lost"):
        # Also in the launcher's own log (its stderr), which outlives a controller killed hard.
        sys.stderr.write(f"troupe-ray {time.strftime('%H:%M:%S')} {kind}: {json.dumps(fields)}\n")
        sys.stderr.flush()
    try:
        sys.stdout.write(EVENT + json.dumps(fields) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass  # the controller is gone; shutting down goes on without it


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG (1): SIGTERM when the thread that started us (the actor's watcher
    # thread, alive exactly as long as the host) goes, e.g. when the actor is killed.
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class HostActor:
    """One `troupe host` process, the child of a Ray actor placed on one bundle."""

    def __init__(self) -> None:
        self._child: Optional["subprocess.Popen[bytes]"] = None
        self._tail: Deque[str] = collections.deque(maxlen=40)
        self._done = threading.Event()
        self._code: Optional[int] = None

    def start(self, argv: List[str], env: Dict[str, str]) -> Dict[str, Any]:
        """Starts the host; returns where it runs (node, pids, GPUs)."""
        ray: Any = importlib.import_module("ray")
        gpus = [str(g) for g in ray.get_gpu_ids()]
        full = dict(os.environ)
        full.update(env)
        if gpus:
            full["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        started = threading.Event()
        failure: List[str] = []

        def run() -> None:
            try:
                child = subprocess.Popen(
                    argv,
                    env=full,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                    start_new_session=True,
                )
            except OSError as e:
                failure.append(f"cannot run {argv[0]}: {e}")
                self._done.set()
                started.set()
                return
            self._child = child
            started.set()
            assert child.stdout is not None
            for raw in child.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                self._tail.append(line)
                sys.stderr.write(line + "\n")
            self._code = child.wait()
            self._done.set()

        threading.Thread(target=run, name="troupe-host", daemon=True).start()
        started.wait()
        if failure:
            raise RuntimeError(failure[0])
        ctx = ray.get_runtime_context()
        assert self._child is not None
        return {
            "pid": self._child.pid,
            "actor_pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpus": gpus,
        }

    def wait(self) -> Dict[str, Any]:
        """Returns once the host has exited: its exit code and last lines of output."""
        self._done.wait()
        return {"code": self._code, "tail": list(self._tail)}

    def stop(self, grace_s: float) -> Optional[int]:
        """SIGTERM to the host's process group, SIGKILL after `grace_s`."""
        child = self._child
        if child is None:
            return None
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self._done.wait(grace_s)
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._done.wait(5.0)
        return self._code


def config_overrides(python: Optional[str] = None) -> List[str]:
    """`troupe.load_config` overrides that place a deployment's hosts on the Ray cluster this
    process is connected to (call it in a driver after `ray.init`): the cluster's address, the
    driver's namespace, and this interpreter for the launcher."""
    ray: Any = importlib.import_module("ray")
    if not ray.is_initialized():
        ray.init()
    ctx = ray.get_runtime_context()
    out = [
        "scheduler.type=ray",
        f"scheduler.address={ctx.gcs_address}",
        f"scheduler.python={python or sys.executable}",
    ]
    ns = ctx.namespace
    if ns:
        out.append(f"scheduler.namespace={ns}")
    return out


def _nodes(ray: Any) -> Dict[str, Dict[str, Any]]:
    return {n["NodeID"]: n for n in ray.nodes()}


def _offer(ray: Any) -> str:
    """What each alive node offers, for error messages."""
    parts = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = {
            k: v
            for k, v in n.get("Resources", {}).items()
            if not k.startswith("node:") and "_group_" not in k and k != "memory"
            and k != "object_store_memory"
        }
        parts.append(f"{n['NodeID'][:12]} {json.dumps(res, sort_keys=True)}")
    return f"{len(parts)} alive node(s): " + "; ".join(parts)


class Launcher:
    """One launch: the placement group, the actors, and their watch."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        self.spec = spec
        self.closing = threading.Event()
        self.ray: Any = None
        self.pg: Any = None
        self.actors: List[Any] = []
        self.nodes: Dict[int, str] = {}
        # Set once connected: before that there is nothing to clean up, and `ray.init` (which
        # retries an unreachable address for a long while) must not hold up a shutdown.
        self.connected = threading.Event()

    def watch_stdin(self) -> None:
        def run() -> None:
            while sys.stdin.readline():
                pass
            self.stop_now()

        threading.Thread(target=run, name="stdin", daemon=True).start()

    def stop_now(self) -> None:
        """Asks for shutdown; exits at once while still connecting (nothing to undo yet)."""
        self.closing.set()
        if not self.connected.is_set():
            os._exit(3)

    def bundles(self) -> List[Dict[str, float]]:
        s = self.spec
        b: Dict[str, float] = {}
        if s["cpus_per_host"] > 0:
            b["CPU"] = float(s["cpus_per_host"])
        if s["gpus_per_host"] > 0:
            b["GPU"] = float(s["gpus_per_host"])
        for k, v in s.get("resources", {}).items():
            b[k] = float(v)
        return [dict(b) for _ in range(s["n_hosts"])]

    def place(self) -> bool:
        """Creates the placement group; False (with an `error` event) when it cannot be."""
        pgs: Any = importlib.import_module("ray.util.placement_group")
        placement_group = pgs.placement_group
        placement_group_table = pgs.placement_group_table

        s = self.spec
        bundles = self.bundles()
        self.pg = placement_group(bundles, strategy=s["strategy"], name=s["name"])
        emit("placing", placement_group=self.pg.id.hex(), bundles=bundles)
        ready = self.pg.ready()
        deadline = time.monotonic() + s["startup_timeout_s"]
        what = f"placement group {self.pg.id.hex()} ({s['strategy']}, {len(bundles)} x {json.dumps(bundles[0] if bundles else {}, sort_keys=True)})"
        while True:
            done, _ = self.ray.wait([ready], timeout=0.5)
            if done:
                self.ray.get(ready)
                break
            if self.closing.is_set():
                return False
            table = placement_group_table(self.pg)
            state = table.get("stats", {}).get("scheduling_state", "")
            if state == "INFEASIBLE" and s.get("fail_infeasible", True):
                emit(
                    "error",
                    message=f"Ray cannot place {what}: scheduling_state INFEASIBLE (no set of nodes can hold these bundles); {_offer(self.ray)}",
                )
                return False
            if time.monotonic() > deadline:
                emit(
                    "error",
                    message=f"Ray did not place {what} within {s['startup_timeout_s']} s: state {table.get('state')}, scheduling_state {state}; {_offer(self.ray)}",
                )
                return False
        table = placement_group_table(self.pg)
        nodes = _nodes(self.ray)
        placed = []
        for i in range(len(bundles)):
            node = table["bundles_to_node_id"].get(i, "")
            placed.append(
                {
                    "index": i,
                    "node_id": node,
                    "node_ip": nodes.get(node, {}).get("NodeManagerAddress", ""),
                }
            )
        self.nodes = {b["index"]: b["node_id"] for b in placed}
        emit("placed", placement_group=self.pg.id.hex(), bundles=placed)
        return True

    def start_hosts(self) -> Dict[Any, int]:
        """Starts one host actor per bundle; returns each host's `wait` reference."""
        strategies: Any = importlib.import_module("ray.util.scheduling_strategies")
        PlacementGroupSchedulingStrategy = strategies.PlacementGroupSchedulingStrategy

        s = self.spec
        actor_cls = self.ray.remote(HostActor)
        env = {k: os.environ[k] for k in s["env_keys"] if k in os.environ}
        starts = []
        for i in range(s["n_hosts"]):
            a = actor_cls.options(
                name=f"{s['name']}-host-{i}",
                num_cpus=float(s["cpus_per_host"]),
                num_gpus=float(s["gpus_per_host"]),
                resources={k: float(v) for k, v in s.get("resources", {}).items()},
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
            ).remote()
            self.actors.append(a)
            argv = list(s["argv"]) + ["--host-index", str(i)]
            starts.append(a.start.remote(argv, env))
        waits: Dict[Any, int] = {}
        for i, ref in enumerate(starts):
            try:
                info = self.ray.get(ref)
            except Exception as e:  # noqa: BLE001 - Ray's own words go to the controller
                node = self.nodes.get(i, "")[:12]
                emit("error", index=i, message=f"host {i} on Ray node {node}: {_short(e)}")
                continue
            emit("started", index=i, **info)
            waits[self.actors[i].wait.remote()] = i
        return waits

    def watch(self, waits: Dict[Any, int]) -> None:
        """Reports each host that exits or whose actor dies, until told to shut down."""
        while not self.closing.is_set():
            if not waits:
                self.closing.wait(0.5)
                continue
            done, _ = self.ray.wait(list(waits), num_returns=1, timeout=0.5)
            for ref in done:
                i = waits.pop(ref)
                try:
                    r = self.ray.get(ref)
                    emit("exited", index=i, code=r["code"], tail=r["tail"][-20:])
                except Exception as e:  # noqa: BLE001 - the actor or its node died
                    emit("lost", index=i, why=_short(e))

    def shutdown(self) -> None:
        """Stops the hosts, kills the actors, removes the placement group."""
        remove_placement_group = importlib.import_module(
            "ray.util.placement_group"
        ).remove_placement_group

        grace = float(self.spec.get("stop_grace_s", 10.0))
        stops = []
        for a in self.actors:
            try:
                stops.append(a.stop.remote(grace))
            except Exception:  # noqa: BLE001 - an actor already gone
                pass
        if stops:
            self.ray.wait(stops, num_returns=len(stops), timeout=grace + 10.0)
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
        emit("done")

    def run(self) -> int:
        s = self.spec
        self.watch_stdin()
        signal.signal(signal.SIGTERM, lambda *_: self.stop_now())
        self.ray = importlib.import_module("ray")
        init: Dict[str, Any] = {
            "address": s.get("address") or "auto",
            "log_to_driver": False,
            "logging_level": "WARNING",
        }
        if s.get("namespace"):
            init["namespace"] = s["namespace"]
        if s.get("runtime_env"):
            init["runtime_env"] = s["runtime_env"]
        try:
            self.ray.init(**init)
        except Exception as e:  # noqa: BLE001
            emit("error", message=f"cannot connect to the Ray cluster at {init['address']}: {_short(e)}")
            return 2
        self.connected.set()
        if self.closing.is_set():
            self.ray.shutdown()
            return 0
        try:
            if self.place():
                waits = self.start_hosts()
                self.watch(waits)
        finally:
            self.shutdown()
            self.ray.shutdown()
        return 0


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _short(e: BaseException) -> str:
    """Ray's words for an error, without its traceback: a task's own exception (`cause`) when
    there is one, else the first line and the line saying why an actor is dead."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    lines = [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    keep = [lines[0]] + [ln for ln in lines[1:] if "is dead because" in ln or "node" in ln.lower() and "died" in ln]
    text = " ".join(keep)
    return text if len(text) < 1000 else text[:1000] + "..."


def main() -> int:
    line = sys.stdin.readline()
    try:
        spec = json.loads(line)
    except json.JSONDecodeError as e:
        emit("error", message=f"bad launch spec on stdin: {e}")
        return 2
    if spec.get("strategy") not in STRATEGIES:
        emit("error", message=f"scheduler.placement_strategy must be one of {', '.join(STRATEGIES)}")
        return 2
    return Launcher(spec).run()


if __name__ == "__main__":
    sys.exit(main())
