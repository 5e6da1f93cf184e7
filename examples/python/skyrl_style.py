#!/usr/bin/env python3
"""A SkyRL-style weight update against a Troupe gateway, with vLLM's endpoint names only.

SkyRL's `RemoteInferenceClient` talks to vLLM servers over HTTP with aiohttp: token-in /
token-out generation on `/inference/v1/generate`, `/pause?mode=keep`, `/resume`,
`/get_world_size`, and no API key. Given a Troupe gateway as both its server URL and its
proxy URL, the same calls drive the whole fleet as one server. Only `aiohttp` is needed.

    python3 skyrl_style.py --gateway http://127.0.0.1:30000 --weights new.safetensors --version 7

Weights go out through `/update_weights_from_tensor` (Troupe's CPU path, where SkyRL would use
NCCL). Exits non-zero if anything is not as it should be.
"""

import argparse
import asyncio
import sys

import aiohttp


async def run(a) -> int:
    url = a.gateway.rstrip("/")
    headers = {"Authorization": f"Bearer {a.admin_key}"} if a.admin_key else {}
    async with aiohttp.ClientSession(headers=headers) as s:

        async def call(method, path, **kw):
            async with s.request(method, url + path, **kw) as r:
                body = await r.json(content_type=None)
                if r.status != 200:
                    raise SystemExit(f"{method} {path}: {r.status} {body}")
                return body

        # SkyRL names the served model in every request; ask the fleet which it serves (a
        # real vLLM refuses any other name).
        model = a.model or (await call("GET", "/v1/models"))["data"][0]["id"]

        async def generate():
            body = {
                "model": model,
                "token_ids": [5, 6, 7, 8],
                "sampling_params": {"max_tokens": 8, "temperature": 0.0, "logprobs": 0},
            }
            out = await call("POST", "/inference/v1/generate", json=body)
            choice = out["choices"][0]
            assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]), choice
            return choice["token_ids"]

        before = await generate()
        world = (await call("GET", "/get_world_size", json={}))["world_size"]

        # SkyRL's weight sync: pause (keep requests in place), load, resume.
        await call("POST", "/pause", params={"mode": "keep", "clear_cache": "false"})
        assert (await call("GET", "/is_paused"))["is_paused"] is True
        with open(a.weights, "rb") as f:
            data = f.read()
        await call(
            "POST",
            "/update_weights_from_tensor",
            params={"weight_version": a.version},
            data=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        await call("POST", "/resume")
        await call("POST", "/reset_prefix_cache", json={"reset_running_requests": False})

        after = await generate()
        version = (await call("GET", "/weight_info"))["weight_version"]
        engines = (await call("GET", "/server_info"))["engines"]
        reported = [e["info"].get("weight_version") for e in engines]
        print(f"world_size {world}; version {version}; engines report {reported}")
        if version != a.version or any(v != a.version for v in reported) or after == before:
            print(f"FAILED: before {before}, after {after}", file=sys.stderr)
            return 1
        print("ok: generation changed and every engine serves the new version")
        return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gateway", required=True, help="http://host:port of the Troupe gateway")
    p.add_argument("--admin-key", default=None, help="only if the gateway requires one")
    p.add_argument("--weights", required=True, help="a safetensors file with the new weights")
    p.add_argument("--version", required=True, help="the weight version to publish")
    p.add_argument("--model", default=None, help="the served model's name (default: the first of GET /v1/models)")
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
