"""Generated tokens/s of the inference engines.

The torch engine (default): TorchEngine with 1, 4 and 16 concurrent requests, against sequential plain `generate`.

    python bench/engine_throughput.py                        # a tiny random model, built on the fly
    python bench/engine_throughput.py --model smollm2-135m   # the real SmolLM2-135M-Instruct (cached after first use)
    python bench/engine_throughput.py --shape qwen2.5-0.5b --device cuda --concurrency 1,16,64

Both sides sample at temperature 1 from the same chat prompts with the same token budget and stop at the model's
eos; tokens/s counts the tokens actually generated. Everything is warmed up before it is timed.

The vLLM engine (`--engine vllm`, needs `make vllm`): a trainable swarm server whose engine is vLLM, in this process
as `marl serve` runs it; N concurrent agents (each on its own lease, streaming chat completions) against the same
vLLM called directly (`/v1/completions` with the same rendered prompt ids, seeds, token ids and logprobs); then the
torch engine behind the same server at `--torch-agents` agents; then the time of one weight sync (export as the
trainer does + `load_weights_from`). The agents run in a separate process (this file with `--load`), so that the
server's work and the load's never share one interpreter.

    python bench/engine_throughput.py --engine vllm --model smollm2-135m    # 1, 16 and 64 agents

`--smoke` runs in seconds without vLLM: the torch bench on the tiny model with tiny counts, then the serving half of
the vLLM bench (the swarm server, agents in their own process over HTTP, a weight sync) on the torch engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from marl.protocol import TrainConfig
from marl.runner.launch import free_port
from servers.backends import SamplingParams
from servers.engines.torch_engine import TorchEngine
from servers.model_files import resolve_model
from tests.tiny_model import build_tiny_model, build_tokenizer

# Open-ended requests, so that a chat model rarely stops before the token budget.
TOPICS = ["a fox", "a lighthouse", "the moon", "a village", "a river", "a robot", "winter", "a market",
          "a storm", "an old clock", "a dragon", "a garden", "a train", "the sea", "a forest", "a violin"]  # fmt: skip


def build_qwen_shaped(directory: Path) -> Path:
    """Qwen2.5-0.5B's shape with random weights, and the tiny tokenizer.

    The tokenizer is not Qwen's: `servers.model_files.load_tokenizer` loads it from tokenizer.json, not as the
    Qwen2Tokenizer that `AutoTokenizer` would pick for model_type qwen2 (docs/backends.md, "transformers: the
    Qwen2Tokenizer trap").
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def sequential_generate(model, engine: TorchEngine, batch: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Plain `model.generate`, one request after the other (what a server without batching does)."""
    tokens = 0
    eos = sorted(engine.eos_token_ids)
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        torch.manual_seed(i)
        input_ids = torch.tensor([ids], device=engine.device)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                                 do_sample=True, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=eos,
                                 pad_token_id=engine.pad_token_id)  # fmt: skip
        tokens += out.shape[1] - len(ids)
    _sync(engine)
    return tokens, time.perf_counter() - start


def concurrent_engine(engine: TorchEngine, batch: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """All of `batch` submitted at once, each request streamed by its own asyncio task."""

    async def one(ids: list[int], seed: int) -> int:
        n = 0
        async for chunk in engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)):
            n += len(chunk.token_ids)
        return n

    async def run() -> int:
        return sum(await asyncio.gather(*(one(ids, i) for i, ids in enumerate(batch))))

    start = time.perf_counter()
    tokens = asyncio.run(run())
    _sync(engine)
    return tokens, time.perf_counter() - start


def _sync(engine: TorchEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# --engine vllm: the engine behind a swarm server, against the same vLLM called directly
# ----------------------------------------------------------------------------------------------------------------

ADMIN_TOKEN = "bench-admin-token"
SERVED_NAME = "bench"


class BenchServer:
    """A trainable swarm server in this process (uvicorn in a thread), ROLLING on `engine_factory`'s engine, with
    a batch too large to ever train (the bench measures serving)."""

    def __init__(self, model_dir: Path, data_dir: Path, engine_factory) -> None:
        from servers.entrypoint import ServeOptions, build_app

        self.port = free_port()
        options = ServeOptions(model=str(model_dir), port=self.port, admin_token=ADMIN_TOKEN, data_dir=data_dir,
                               served_model_name=SERVED_NAME)
        app = build_app(options, engine_factory=engine_factory)
        self.server = app.state.server
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60,
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    def __enter__(self) -> BenchServer:
        self._thread.start()
        while not self._uvicorn.started:
            time.sleep(0.05)
        config = TrainConfig(batch_size=100_000, num_repeat=1, max_leases=1024, lease_patience_s=3600, save_freq=0)
        self.http.post("/control/config", json=config.model_dump(mode="json")).raise_for_status()
        self.http.post("/control/start").raise_for_status()
        deadline = time.monotonic() + 900
        while (status := self.http.get("/control/status").json())["state"] != "ROLLING":
            if status["state"] == "OFFLINE" or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {status.get('last_error')}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.post("/control/stop")
        self.http.close()
        self._uvicorn.should_exit = True
        self._thread.join(timeout=60)

    @property
    def engine(self):
        return self.server.lifecycle.engine

    def run_agents(self, chats: list[list[dict]], calls: int, max_tokens: int) -> tuple[int, float]:
        """`len(chats)` agents, each on a lease of its own, `calls` streamed chat completions each."""
        leases = [self.http.post("/episodes/begin", json={"client_id": "bench"}).json() for _ in chats]
        try:
            targets = [{"base_url": lease["base_url"], "api_key": lease["api_key"]} for lease in leases]
            return agents_process({"mode": "chat", "targets": targets, "model": SERVED_NAME, "inputs": chats,
                                   "calls": calls, "max_tokens": max_tokens})
        finally:
            for lease in leases:
                self.http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "bench"})


def direct_vllm(engine, model_dir: Path, prompt_ids: list[list[int]], calls: int, max_tokens: int) -> tuple[int, float]:
    """The same agents against the engine's vLLM itself, by token ids, asking for the same ids and logprobs."""
    target = {"base_url": f"{engine.url}/v1", "api_key": "unused"}
    return agents_process({"mode": "completions", "targets": [target], "model": str(model_dir), "inputs": prompt_ids,
                           "calls": calls, "max_tokens": max_tokens})


def agents_process(spec: dict) -> tuple[int, float]:
    """Run `run_agents(spec)` in a fresh process (this file with --load); (tokens generated, seconds)."""
    done = subprocess.run([sys.executable, __file__, "--load"], input=json.dumps(spec), capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the agents' process failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["tokens"], result["seconds"]


async def run_agents(spec: dict) -> dict:
    """Every input is one agent making `calls` streamed calls one after the other; all agents at once."""
    import openai

    clients = [openai.AsyncOpenAI(base_url=t["base_url"], api_key=t["api_key"], max_retries=0, timeout=3600)
               for t in spec["targets"]]

    async def agent(index: int, item) -> int:
        client, tokens = clients[index % len(clients)], 0
        for call in range(spec["calls"]):
            common = {"model": spec["model"], "max_tokens": spec["max_tokens"], "temperature": 1.0,
                      "seed": 1000 * index + call, "stream": True, "stream_options": {"include_usage": True}}
            if spec["mode"] == "chat":
                stream = await client.chat.completions.create(messages=item, **common)
            else:  # what the vLLM engine asks of vLLM: exact token ids and the sampled tokens' logprobs
                stream = await client.completions.create(prompt=item, logprobs=0,
                                                         extra_body={"return_token_ids": True}, **common)
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
        return tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(agent(i, item) for i, item in enumerate(spec["inputs"])))
    return {"tokens": sum(counts), "seconds": time.perf_counter() - start}


def time_weight_syncs(engine, model_dir: Path, scratch: Path, repeats: int) -> list[tuple[float, float]]:
    """(export seconds, load seconds) of `repeats` syncs: the weights saved as the trainer exports them
    (`save_pretrained`), then `engine.load_weights_from` (drain, reload in place, prefix cache reset, resume)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    times = []
    for i in range(repeats):
        out = scratch / f"export-{i}"
        start = time.perf_counter()
        model.save_pretrained(out)
        exported = time.perf_counter()
        engine.load_weights_from(out)
        times.append((exported - start, time.perf_counter() - exported))
        shutil.rmtree(out)
    return times


def vllm_bench(args: argparse.Namespace) -> None:
    from servers.engines.vllm_engine import vllm_engine_factory
    from servers.entrypoint import torch_engine_factory
    from servers.model_files import load_tokenizer

    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        # vLLM's CPU attention needs head_dim >= 32: the tiny model gets 2 heads of 32
        model_dir = resolve_model(args.model) if args.model else build_tiny_model(Path(tmp) / "tiny", num_heads=2)
        print(f"model: {args.model or 'tiny random llama'}, {args.calls} calls x {args.max_tokens} tokens per agent,"
              f" load average {os.getloadavg()[0]:.1f}", flush=True)
        agents = max(*levels, args.torch_agents)
        chats = [[{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]
                 for i in range(agents)]
        prompt_ids = prompts(load_tokenizer(model_dir), agents)
        rows, marl_rates = [], {}
        with BenchServer(model_dir, Path(tmp) / "vllm-server", vllm_engine_factory(args.device)) as server:
            direct_vllm(server.engine, model_dir, prompt_ids[:1], 1, 8)  # warm-up
            server.run_agents(chats[:1], 1, 8)
            for level in sorted({*levels, args.torch_agents}):
                runs = [(direct_vllm(server.engine, model_dir, prompt_ids[:level], args.calls, args.max_tokens),
                         server.run_agents(chats[:level], args.calls, args.max_tokens)) for _ in range(args.repeats)]
                direct, marl = (max((run[i] for run in runs), key=lambda r: r[0] / r[1]) for i in (0, 1))
                marl_rates[level] = marl[0] / marl[1]
                if level in levels:
                    rows.append((level, direct, marl))
                print(f"  {level} agents done", flush=True)
            syncs = time_weight_syncs(server.engine, model_dir, Path(tmp), args.weight_syncs)
        with BenchServer(model_dir, Path(tmp) / "torch-server", torch_engine_factory(args.device)) as server:
            server.run_agents(chats[:1], 1, 8)  # warm-up
            torch_run = server.run_agents(chats[:args.torch_agents], args.calls, args.max_tokens)
    report_vllm(rows, marl_rates[args.torch_agents], torch_run, args.torch_agents, syncs)


def report_vllm(rows, vllm_rate: float, torch_run: tuple[int, float], torch_agents: int,
                syncs: list[tuple[float, float]]) -> None:
    print(f"\n{'agents':>6} {'direct vLLM tok/s':>18} {'through marl tok/s':>19} {'marl / direct':>14}"
          f" {'tokens (direct, marl)':>22}")
    for level, (d_tokens, d_seconds), (m_tokens, m_seconds) in rows:
        direct, marl = d_tokens / d_seconds, m_tokens / m_seconds
        print(f"{level:>6} {direct:>18.1f} {marl:>19.1f} {marl / direct:>14.2f} {f'{d_tokens}, {m_tokens}':>22}")
    torch_rate = torch_run[0] / torch_run[1]
    print(f"\n{torch_agents} agents through marl: vLLM engine {vllm_rate:.1f} tok/s, torch engine {torch_rate:.1f}"
          f" tok/s ({vllm_rate / torch_rate:.2f}x)")
    print("\nweight sync (export + load_weights_from): " + ", ".join(
        f"{export:.2f} + {load:.2f} = {export + load:.2f} s" for export, load in syncs))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--model", help="model directory or alias (smollm2-135m); default: a tiny random model")
    parser.add_argument("--shape", choices=["qwen2.5-0.5b"], help="random weights of this shape (GPU benchmark)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated concurrent request counts (default: 1,4,16; with --engine vllm 1,16,64)")
    parser.add_argument("--sequential-requests", type=int, default=4, help="requests timed for the baseline")
    parser.add_argument("--calls", type=int, default=2, help="--engine vllm: calls per agent")
    parser.add_argument("--torch-agents", type=int, default=16, help="--engine vllm: agents of the torch comparison")
    parser.add_argument("--weight-syncs", type=int, default=3, help="--engine vllm: weight syncs timed")
    parser.add_argument("--repeats", type=int, default=2,
                        help="--engine vllm: runs of each side per level, alternating; the best of each counts"
                             " (shared CPUs)")
    parser.add_argument("--load", action="store_true", help=argparse.SUPPRESS)  # the agents' process (stdin: spec)
    parser.add_argument("--smoke", action="store_true", help="a few seconds, tiny model, no vLLM: does the bench run?")
    args = parser.parse_args()
    if args.model and args.shape:
        parser.error("--model and --shape exclude each other")
    if args.engine == "vllm" and args.shape:
        parser.error("--shape is for the torch engine")
    args.concurrency = args.concurrency or ("1,16,64" if args.engine == "vllm" else "1,4,16")
    return args


def main() -> None:
    args = parse_args()
    if args.load:
        print(json.dumps(asyncio.run(run_agents(json.load(sys.stdin)))))
    elif args.smoke:
        smoke_bench(args)
    elif args.engine == "vllm":
        vllm_bench(args)
    else:
        torch_bench(args)


def smoke_bench(args: argparse.Namespace) -> None:
    """The torch bench on tiny counts, then `vllm_bench`'s serving path with the torch engine (vLLM is not run)."""
    from servers.entrypoint import torch_engine_factory

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        args.model, args.shape = str(model_dir), None
        args.concurrency, args.max_tokens, args.sequential_requests = "1,2", 4, 2
        torch_bench(args)
        chats = [[{"role": "user", "content": f"Write a long story about {topic}."}] for topic in TOPICS[:2]]
        with BenchServer(model_dir, Path(tmp) / "server", torch_engine_factory("cpu")) as server:
            tokens, seconds = server.run_agents(chats, calls=1, max_tokens=4)
            syncs = time_weight_syncs(server.engine, model_dir, Path(tmp), repeats=1)
    print(f"\n2 agents through marl (torch engine): {tokens} tokens in {seconds:.2f} s; weight sync "
          + ", ".join(f"{export:.2f} + {load:.2f} s" for export, load in syncs) + " (vLLM not run in smoke mode)")


def torch_bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            model_dir, label = build_qwen_shaped(Path(tmp)), f"{args.shape} (random weights)"
        elif args.model:
            model_dir, label = resolve_model(args.model), args.model
        else:
            model_dir, label = build_tiny_model(Path(tmp)), "tiny random llama"
        levels = [int(c) for c in args.concurrency.split(",")]
        with TorchEngine(model_dir, device=args.device, max_batch_size=max(levels)) as engine:
            params = sum(p.numel() for p in engine.model.parameters())
            print(f"model: {label}, {params / 1e6:.1f}M parameters, {engine.device} {engine.dtype}, "
                  f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, "
                  f"weight-major CPU matmul: {engine.weight_major_matmul}", flush=True)  # fmt: skip
            batch = prompts(engine.tokenizer, max(max(levels), args.sequential_requests))
            print(f"prompts: {min(map(len, batch))}-{max(map(len, batch))} tokens, max_tokens {args.max_tokens}")

            # The baseline gets its own untouched copy of the model (the engine may swap its CPU matmul variant).
            plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine.dtype).to(engine.device).eval()
            # Warm-up: first calls allocate, pick kernels (and on CUDA, initialise the context).
            sequential_generate(plain, engine, batch[:1], 8)
            concurrent_engine(engine, batch[: max(levels)], 8)

            rows = []
            tokens, seconds = sequential_generate(plain, engine, batch[: args.sequential_requests], args.max_tokens)
            baseline = tokens / seconds
            rows.append((f"plain generate, {args.sequential_requests} sequential", tokens, seconds, baseline))
            for level in levels:
                before = engine.stats.forwards
                tokens, seconds = concurrent_engine(engine, batch[:level], args.max_tokens)
                forwards = engine.stats.forwards - before
                name = f"TorchEngine, {level} concurrent ({forwards} forwards)"
                rows.append((name, tokens, seconds, tokens / seconds))

    print(f"\n{'run':<44} {'tokens':>7} {'seconds':>8} {'tok/s':>9} {'vs plain':>9}")
    for name, tokens, seconds, rate in rows:
        print(f"{name:<44} {tokens:>7} {seconds:>8.2f} {rate:>9.1f} {rate / baseline:>8.2f}x")



if __name__ == "__main__":
    main()
