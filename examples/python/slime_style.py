#!/usr/bin/env python3
"""A slime-style weight update against a Troupe gateway, with SGLang's endpoint names only.

slime drives SGLang servers with plain HTTP: pause generation, flush the cache, load new
weights, continue. Pointed at a Troupe gateway, the same calls reach every engine of the fleet
(prefill and decode alike) at once. No Troupe package is needed: only `requests`.

    python3 slime_style.py --gateway http://127.0.0.1:30000 --admin-key KEY \
        --weights new.safetensors --version 7

The weights are a safetensors file (what a trainer saves); they go to every engine through
`/update_weights_from_tensor` (Troupe's CPU path: the gateway broadcasts them). Exits non-zero
if anything is not as it should be.
"""

import argparse
import sys
import time

import requests


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gateway", required=True, help="http://host:port of the Troupe gateway")
    p.add_argument("--admin-key", default=None, help="the deployment's admin key")
    p.add_argument("--weights", required=True, help="a safetensors file with the new weights")
    p.add_argument("--version", required=True, help="the weight version to publish")
    a = p.parse_args()

    s = requests.Session()
    if a.admin_key:
        s.headers["Authorization"] = f"Bearer {a.admin_key}"
    url = a.gateway.rstrip("/")

    def post(path, **kw):
        r = s.post(url + path, timeout=120, **kw)
        if r.status_code != 200:
            raise SystemExit(f"POST {path}: {r.status_code} {r.text}")
        return r.json()

    def get(path):
        r = s.get(url + path, timeout=60)
        if r.status_code != 200:
            raise SystemExit(f"GET {path}: {r.status_code} {r.text}")
        return r.json()

    prompt = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    before = post("/generate", json=prompt)["output_ids"]
    old = get("/get_weight_version")["weight_version"]

    # slime's update: pause, flush (retried while requests drain), load, continue.
    post("/pause_generation", json={})
    for _ in range(60):
        if s.get(url + "/flush_cache", timeout=60).status_code == 200:
            break
        time.sleep(0.2)
    else:
        raise SystemExit("the fleet's cache never flushed")
    with open(a.weights, "rb") as f:
        answer = post(
            f"/update_weights_from_tensor?weight_version={a.version}",
            data=f.read(),
            headers={"Content-Type": "application/octet-stream"},
        )
    post("/continue_generation", json={})

    after = post("/generate", json=prompt)["output_ids"]
    version = get("/get_weight_version")["weight_version"]
    engines = get("/server_info")["engines"]
    reported = [e["info"].get("weight_version") for e in engines]
    print(f"version {old} -> {version}; {len(engines)} engines report {reported}; pushed {answer['bytes']} bytes")
    ok = (
        version == a.version
        and all(v == a.version for v in reported)
        and after != before
    )
    if not ok:
        print(f"FAILED: before {before}, after {after}", file=sys.stderr)
        return 1
    print("ok: generation changed and every engine serves the new version")
    return 0


if __name__ == "__main__":
    sys.exit(main())
