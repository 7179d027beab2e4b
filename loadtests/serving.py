"""Serving benchmark in the manner of `vllm bench serve`: a seeded ShareGPT-like synthetic workload
sent to an OpenAI-compatible endpoint (streaming, Poisson or fixed-rate arrivals, a concurrency cap
or a sweep), or run through the offline `shoal.LLM` in-process for the served-vs-offline ratio.

    .venv/bin/python -m loadtests.serving --base-url http://127.0.0.1:8000 --model NAME \
        --num-prompts 64 --request-rate 4 --max-concurrency 32 [--sweep 1,8,32] \
        [--compare-offline --model-path PATH.gguf|FOLDER]

Reports vLLM's names (request/output/total token throughput; mean/median/p99 TTFT, TPOT, ITL, E2EL
in ms) as JSON under loadtests/results/ and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = ("the of and to in is was for on that with as by at from his her an were are which this "
         "be river city history model paris music science garden winter market story engine "
         "light road question answer people water time world number system night family "
         "mountain").split()


@dataclass(frozen=True, slots=True)
class Sample:
    prompt: str
    input_len: int
    """Words in the prompt (the real token count comes back in usage)."""
    output_len: int


@dataclass(slots=True)
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    engine_ttft: float = 0.0
    """The engine's own queue + prefill for this request (arrival -> first token, its
    RequestMetrics), where known: ttft - engine_ttft is what the path around the engine adds."""
    engine_queue: float = 0.0
    """Of which in the engine's queue (arrival -> first scheduled)."""


def synthetic_sharegpt(num: int, seed: int, max_input: int, max_output: int,
                       shared_prefix: int = 0) -> list[Sample]:
    """Log-normal prompt and answer lengths shaped like ShareGPT's, clipped to the limits given."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(shared_prefix))
    samples = []
    for _ in range(num):
        in_len = max(4, min(max_input, int(rng.lognormvariate(math.log(max_input / 4), 0.8))))
        out_len = max(4, min(max_output, int(rng.lognormvariate(math.log(max_output / 3), 0.7))))
        words = " ".join(rng.choice(WORDS) for _ in range(in_len))
        samples.append(Sample(f"{prefix} {words}".strip(), in_len + shared_prefix, out_len))
    return samples


def arrival_gaps(num: int, rate: float, kind: str, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) if kind == "poisson" else 1.0 / rate for _ in range(num)]


async def one_request(session, url: str, model: str, sample: Sample) -> Result:  # type: ignore[no-untyped-def]
    body = {"model": model, "prompt": sample.prompt, "max_tokens": sample.output_len,
            "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = event["error"].get("message", "stream error")
                    return res
                if event.get("usage"):
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
                    res.output_tokens = event["usage"]["completion_tokens"]
                if any(c.get("text") for c in event.get("choices", [])):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_served(url: str, model: str, samples: list[Sample], rate: float, arrivals: str,
                     max_concurrency: int | None, seed: int) -> tuple[list[Result], float]:
    import aiohttp

    limit = asyncio.Semaphore(max_concurrency or len(samples))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def limited(sample: Sample) -> Result:
            async with limit:
                return await one_request(session, url, model, sample)

        tasks, done = [], 0
        start = time.perf_counter()
        for sample, gap in zip(samples, arrival_gaps(len(samples), rate, arrivals, seed)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(sample)))
        results = []
        for next_done in asyncio.as_completed(tasks):
            results.append(await next_done)
            done += 1
            if done % max(1, len(samples) // 10) == 0 or done == len(samples):
                print(f"  {done}/{len(samples)} requests done ({time.perf_counter() - start:.1f}s)",
                      flush=True)
        return results, time.perf_counter() - start


def run_offline(model_path: str, samples: list[Sample], max_concurrency: int | None,
                engine_args: dict[str, int], llm: Any = None) -> tuple[list[Result], float]:
    """The same workload on an in-process engine, keeping at most `max_concurrency` in flight
    (`llm`: one already loaded, reused across runs; else one is made from `model_path`)."""
    from shoal import LLM
    from shoal.services.engine.core.request_output import RequestOutputKind
    from shoal.services.engine.sampling_params import SamplingParams

    llm = llm if llm is not None else LLM(model_path, **engine_args)
    core, tokenizer = llm.engine, llm.get_tokenizer()
    pending = list(enumerate(samples))
    cap = max_concurrency or len(samples)
    results: dict[int, Result] = {}
    in_flight: dict[str, tuple[int, float]] = {}
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < cap:
            i, sample = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=sample.output_len, ignore_eos=True)
            core.add_request(str(i), tokenizer.encode(sample.prompt), params, prompt=sample.prompt,
                             output_kind=RequestOutputKind.DELTA)
            in_flight[str(i)] = (i, time.perf_counter())
        for out in core.step():
            i, began = in_flight[out.request_id]
            res = results.setdefault(i, Result(prompt_tokens=len(out.prompt_token_ids)))
            now = time.perf_counter()
            if out.num_generated_tokens:
                if res.output_tokens == 0:
                    res.ttft = now - began
                    m = out.metrics
                    if m is not None and m.first_token_time is not None:
                        res.engine_ttft = m.first_token_time - m.arrival_time
                        res.engine_queue = (m.first_scheduled_time or m.arrival_time
                                            ) - m.arrival_time
                else:
                    res.itl.append(now - began - res.e2e)
                res.e2e = now - began
                res.output_tokens += out.num_generated_tokens
            if out.finished:
                res.ok, res.e2e = True, now - began
                del in_flight[out.request_id]
    return [results[i] for i in sorted(results)], time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    report: dict[str, float] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    series = {"ttft": [r.ttft for r in ok], "e2el": [r.e2e for r in ok],
              "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [gap for r in ok for gap in r.itl]}
    if ok and all(r.engine_ttft > 0 for r in ok):  # TTFT less the engine's queue + prefill
        series["overhead"] = [r.ttft - r.engine_ttft for r in ok]
        series["engine_ttft"] = [r.engine_ttft for r in ok]
        series["engine_queue"] = [r.engine_queue for r in ok]
    for name, values in series.items():
        ms = sorted(v * 1000 for v in values) or [0.0]
        report[f"mean_{name}_ms"] = statistics.fmean(ms)
        report[f"median_{name}_ms"] = statistics.median(ms)
        report[f"std_{name}_ms"] = statistics.pstdev(ms)
        report[f"p99_{name}_ms"] = ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]
    return report


def plot(runs: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for backend in sorted({str(r["backend"]) for r in runs}):
        rows = [r for r in runs if r["backend"] == backend]
        xs = [int(r["max_concurrency"] or 0) or len(rows) for r in rows]
        metrics = [r["metrics"] for r in rows]
        axes[0].plot(xs, [m["output_throughput"] for m in metrics], "o-", label=backend)  # type: ignore[index]
        for key, style in (("median", "o-"), ("p99", "x--")):
            ttft = [m[f"{key}_ttft_ms"] for m in metrics]  # type: ignore[index]
            tpot = [m[f"{key}_tpot_ms"] for m in metrics]  # type: ignore[index]
            axes[1].plot(xs, ttft, style, label=f"{backend} {key}")
            axes[2].plot(xs, tpot, style, label=f"{backend} {key}")
    for ax, title in zip(axes, ("output tokens/s", "TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default inf: all at once)")
    p.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--sweep", help="comma-separated concurrencies, e.g. 1,8,32 (rate inf)")
    p.add_argument("--max-input", type=int, default=256, help="longest prompt in words")
    p.add_argument("--max-output", type=int, default=128, help="longest answer in tokens")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="words of a prefix shared by every prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["served", "offline"], default="served")
    p.add_argument("--compare-offline", action="store_true",
                   help="also run the workload through shoal.LLM")
    p.add_argument("--model-path", help="folder or .gguf for the offline run")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="KEY=INT for the offline engine")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default loadtests/results/...)")
    args = p.parse_args(argv)

    samples = synthetic_sharegpt(args.num_prompts, args.seed, args.max_input, args.max_output,
                                 args.shared_prefix)
    concurrencies: list[int | None] = ([int(c) for c in args.sweep.split(",")] if args.sweep
                                       else [args.max_concurrency])
    backends = ["served", "offline"] if args.compare_offline else [args.backend]
    if "offline" in backends and not args.model_path:
        p.error("--model-path is needed for the offline backend")
    engine_args = {k: int(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    runs: list[dict[str, object]] = []
    for backend in backends:
        for conc in concurrencies:
            rate = math.inf if args.sweep else args.request_rate
            print(f"{backend}: {len(samples)} prompts, concurrency {conc or 'unbounded'}, "
                  f"rate {rate}", flush=True)
            if backend == "served":
                results, duration = asyncio.run(run_served(args.base_url.rstrip("/"), args.model,
                                                           samples, rate,
                                                           args.arrivals, conc, args.seed))
            else:
                results, duration = run_offline(args.model_path, samples, conc, engine_args)
            metrics = summarize(results, duration)
            errors = sorted({r.error for r in results if not r.ok})[:3]
            runs.append({"backend": backend, "max_concurrency": conc, "request_rate": str(rate),
                         "metrics": metrics, "errors": errors})
            print(json.dumps({k: round(v, 2) for k, v in metrics.items()}), flush=True)
    summary: dict[str, object] = {"model": args.model, "num_prompts": args.num_prompts,
                                  "seed": args.seed,
                                  "max_input": args.max_input, "max_output": args.max_output,
                                  "runs": runs}
    if args.compare_offline:
        served = {r["max_concurrency"]: r["metrics"] for r in runs if r["backend"] == "served"}
        offline = {r["max_concurrency"]: r["metrics"] for r in runs if r["backend"] == "offline"}
        pairs = {c: (served[c], offline[c]) for c in served if c in offline}
        summary["served_vs_offline"] = {
            str(c): {"output_throughput_ratio": s["output_throughput"] / o["output_throughput"],  # type: ignore[index]
                     "added_median_ttft_ms": s["median_ttft_ms"] - o["median_ttft_ms"]}  # type: ignore[index]
            for c, (s, o) in pairs.items()}
        print("served vs offline:", json.dumps(summary["served_vs_offline"]), flush=True)
    out = args.out or RESULTS / f"serving-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(not r["errors"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
