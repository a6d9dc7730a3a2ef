"""The HTTP wire between the vLLM engine and its vLLM subprocess.

- Generation: `/v1/completions` with the prompt as token ids (vLLM never re-tokenizes it), with `return_token_ids`
  (the exact generated ids), `logprobs: 0` (the sampled token's logprob; vLLM's default `logprobs_mode` is raw
  logprobs: log softmax of the unscaled logits, as the trainer computes them) and the usage (how many prompt tokens
  vLLM's prefix cache supplied). Streamed when marl's caller streams (`stream_completion`); otherwise one reply
  (`whole_completion`): a streamed generation is one server-sent event per token for marl's process to read, about
  9,000 a second at vLLM's 256 running sequences. A generation that must begin with one of a few token sequences
  (`SamplingParams.lead`: a forced tool call's declared names) carries them in `vllm_xargs`, for marl's logits
  processor (`vllm_lead`), which vLLM applies after it took the raw logprobs. (vLLM's own structured outputs, e.g. a
  `choice`, mask the logits before the logprobs are taken: the logprobs would be renormalised over the names.)
- Weight sync: the dev routes of `VLLM_SERVER_DEV_MODE` (pause, collective RPC into the worker extension, prefix
  cache reset, resume); with sleep mode (CUDA only), sleep before the training step, then wake the weights, reload,
  wake the KV cache. Through vLLM's weight-transfer engine the same calls surround the trainer's push instead of the
  reload (`before_transfer`, `after_transfer`; the push itself: servers.engines.weight_transfer).
- A paused vLLM that refuses a new generation (vLLM 0.33: 503 with error type `ServiceUnavailableError`, or, streamed,
  HTTP 200 and an SSE error event before any token) is told apart once, in `paused_error`, and raised as
  `VLLMPaused` for the engine to send it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx

from servers.backends import GenerationChunk, SamplingParams
from servers.engines.lead_tokens import lead_to_strings
from servers.engines.wake_memory import wake_problem

__all__ = ["PAUSED_ERROR", "PAUSED_ERRORS", "LoopClients", "VLLMPaused", "after_transfer", "before_transfer",
           "completion_body", "generate_one_token", "paused_error", "paused_refusal", "reset_prefix_cache",
           "sleep_for_training", "stream_completion", "sync_weights", "sync_weights_waking", "transfer_abandoned",
           "wake_fits", "whole_completion", "VLLMWakeRefused"]

#: The `vllm_xargs` key of `SamplingParams.lead`, which `vllm_lead.LeadConstraint` reads in vLLM's process.
LEAD_ARG = "marl_lead"

#: (prompt tokens, of which served from vLLM's prefix cache), once per finished generation.
UsageSink = Callable[[int, int], None]


class LoopClients:
    """One `httpx.AsyncClient` per event loop: a client belongs to the loop it was made on (benches run several
    loops in turn)."""

    def __init__(self) -> None:
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = \
            weakref.WeakKeyDictionary()

    def get(self) -> httpx.AsyncClient:
        """The running loop's client."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits)
            self._clients[loop] = client
        return client


def completion_body(prompt_ids: list[int], params: SamplingParams, *, max_tokens: int,
                    stop_token_ids: list[int]) -> dict[str, Any]:
    """A `/v1/completions` request that samples exactly as `params` says and reports exact tokens; streamed as
    `params.stream` says."""
    body = {
        "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": params.temperature, "top_p": params.top_p,
        "seed": params.seed, "stop": list(params.stop) or None, "stop_token_ids": stop_token_ids,
        "logprobs": 0, "return_token_ids": True, "stream": params.stream,
    }
    if params.stream:
        body["stream_options"] = {"include_usage": True}
    if params.lead:  # applied by marl's logits processor in vLLM (vllm_lead), after vLLM took the raw logprobs
        body["vllm_xargs"] = {LEAD_ARG: lead_to_strings(params.lead)}
    return body


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            on_usage: UsageSink) -> AsyncIterator[GenerationChunk]:
    """Stream vLLM's answer as `GenerationChunk`s; the last one carries the finish reason.

    ValueError when vLLM refuses the request (4xx), RuntimeError when the generation fails or the stream ends early;
    httpx errors (vLLM unreachable or gone) pass through.
    """
    last: GenerationChunk | None = None
    started = False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            _refused(response.status_code, await response.aread())
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if not started and paused_error(event.get("error")):  # refused before any token: send it again
                raise VLLMPaused(f"vLLM is paused: {line[:200]}")
            started = True
            _count_usage(event, on_usage)
            chunk = _chunk(event)
            if chunk is None:
                continue
            if chunk.finish_reason is not None:
                last = chunk  # sent once the stream ends: its usage is counted by then
            else:
                yield chunk
    if last is None:
        raise RuntimeError("the vLLM stream ended before the generation finished")
    yield last


async def whole_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                           on_usage: UsageSink) -> AsyncIterator[GenerationChunk]:
    """vLLM's answer to a request that is not streamed (`body["stream"]` False), as one finished `GenerationChunk`;
    errors as `stream_completion`'s."""
    response = await client.post(f"{url}/v1/completions", json=body)
    if response.status_code != 200:
        _refused(response.status_code, response.content)
    event = response.json()
    _count_usage(event, on_usage)
    chunk = _chunk(event)
    if chunk is None or chunk.finish_reason is None:
        raise RuntimeError(f"vLLM's reply holds no finished generation: {response.text[:1000]}")
    yield chunk


class VLLMPaused(RuntimeError):
    """vLLM refused a new generation because it is paused (`paused_refusal`): worth sending again once it resumes."""


#: The error types and codes that say "paused, send it again" (docs/backends.md, "vLLM: requests during a weight
#: sync"). vLLM 0.33 refuses a new request while paused with a retryable error (code `engine_paused` inside its
#: engine), which its HTTP layer turns into `{"error": {"type": "ServiceUnavailableError", "code": 503, ...}}`: status
#: 503, or in a stream HTTP 200 and that body as an SSE event. `engine_paused` is kept for a vLLM that would say so.
#: The CPU build 0.32 queues such requests instead and sends none of this.
PAUSED_ERRORS = ("ServiceUnavailableError", "engine_paused")
PAUSED_ERROR = "engine_paused"


def paused_error(error: object) -> bool:
    """Whether an OpenAI-shaped error (`{"message", "type", "param", "code"}`) is vLLM's "retry later": its type or
    code one of `PAUSED_ERRORS`. The one place that decides; the message text is never read."""
    return isinstance(error, dict) and any(error.get(key) in PAUSED_ERRORS for key in ("type", "code"))


def paused_refusal(status: int, content: bytes) -> bool:
    """Whether a whole (non-streamed) answer is the refusal of a paused vLLM: a 503 carrying a `paused_error`."""
    if status != 503:
        return False
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return False
    return paused_error(error)


def _refused(status: int, content: bytes) -> None:
    if paused_refusal(status, content):
        raise VLLMPaused(f"vLLM is paused: {content.decode(errors='replace')[:200]}")
    error = ValueError if 400 <= status < 500 else RuntimeError
    raise error(f"vLLM answered {status}: {content.decode(errors='replace')[:1000]}")


def _count_usage(event: dict[str, Any], on_usage: UsageSink) -> None:
    if usage := event.get("usage"):
        details = usage.get("prompt_tokens_details") or {}
        on_usage(int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0))


def _chunk(event: dict[str, Any]) -> GenerationChunk | None:
    if "error" in event:
        raise RuntimeError(f"vLLM failed the generation: {event['error']}")
    if not event.get("choices"):
        return None
    choice = event["choices"][0]
    ids = choice.get("token_ids") or []
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM sent {len(ids)} token ids with {len(logprobs)} logprobs")
    finish = choice.get("finish_reason")
    if finish not in (None, "stop", "length"):
        raise RuntimeError(f"vLLM ended the generation with finish_reason {finish!r}")
    if not ids and finish is None:
        return None
    return GenerationChunk(token_ids=[int(t) for t in ids], logprobs=[float(lp) for lp in logprobs],
                           finish_reason=finish)


def generate_one_token(url: str, timeout_s: float = 300.0) -> None:
    """A one-token generation: raises when vLLM started but cannot run the model (e.g. a head size its CPU attention
    lacks only fails at the first forward pass), and warms it up (the first request is seconds slower)."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0)) as http:
        _checked(http.post("/v1/completions", json={"prompt": [0], "max_tokens": 1}))


def sync_weights(url: str, weights_dir: Path, timeout_s: float = 600.0) -> None:
    """Have vLLM serve the safetensors in `weights_dir`: wait for the running requests to finish on the old weights
    (`/pause?mode=wait`; requests that arrive meanwhile are held, then run on the new ones), reload in place through
    the worker extension, empty the prefix cache (its keys/values came from the old weights), resume."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0)) as http:
        _checked(http.post("/pause", params={"mode": "wait"}, timeout=None))  # as long as the running requests take
        try:
            _reload(http, weights_dir)
            _reset_prefix_cache(http)
        except BaseException:
            with contextlib.suppress(httpx.HTTPError):
                http.post("/resume")
            raise
        _checked(http.post("/resume"))


def reset_prefix_cache(url: str, timeout_s: float = 60.0) -> None:
    """Empty vLLM's prefix cache (benches compare routings from a cold cache)."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0)) as http:
        _reset_prefix_cache(http)


#: How often, and how far apart, an unsuccessful prefix-cache reset is tried again.
RESET_TRIES, RESET_WAIT_S = 20, 0.25


def _reset_prefix_cache(http: httpx.Client) -> None:
    """`/reset_prefix_cache`, tried again while vLLM answers 200 `{"success": false}` (0.32 and 0.33: blocks still
    held, e.g. by an asynchronous KV offload; "callers may retry"); RuntimeError after `tries`, because serving on
    with cached keys and values of the old weights would sample from a model nobody trains (invariant 4): the sync
    fails as any failed sync does. An answer without the field (an older vLLM) counts as done. `RESET_TRIES` and
    `RESET_WAIT_S` are read at each call."""
    for attempt in range(RESET_TRIES):
        if _answer(_checked(http.post("/reset_prefix_cache"))).get("success") is not False:
            return
        if attempt + 1 < RESET_TRIES:
            time.sleep(RESET_WAIT_S)
    raise RuntimeError(f"vLLM did not empty its prefix cache ({RESET_TRIES} tries {RESET_WAIT_S} s apart answered"
                       " success: false): its blocks still hold keys and values of the old weights")


def sleep_for_training(url: str, timeout_s: float = 600.0) -> None:
    """Free vLLM's GPU memory for a training step (sleep mode: `--enable-sleep-mode`, CUDA only): let the running
    requests finish (`mode=wait`; new ones are held), then offload the weights to host memory and drop the KV cache,
    prefix cache included (`level=1`)."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0)) as http:
        _checked(http.post("/sleep", params={"level": 1, "mode": "wait"}, timeout=None))


class VLLMWakeRefused(RuntimeError):
    """vLLM's KV cache would not fit in its GPUs' free memory: not woken (the wake would kill its engine core)."""


#: The setting to lower when the KV cache does not fit (`VLLMLaunch.kv_setting` names the one in use).
KV_SETTING = "vllm.gpu_memory_utilization"


def wake_fits(url: str, kv_setting: str = KV_SETTING, timeout_s: float = 60.0) -> None:
    """Before `/wake_up?tags=kv_cache`: VLLMWakeRefused, one line naming each GPU short of memory, what holds it
    and `kv_setting`, unless every worker has room for the KV cache it will map again (servers.engines.wake_memory;
    the readings come from the worker extension)."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0)) as http:
        readings = _answer(_checked(http.post("/collective_rpc", json={"method": "marl_wake_memory"})))
    problem = wake_problem([r for r in readings.get("results") or [] if isinstance(r, dict)], kv_setting)
    if problem is not None:
        raise VLLMWakeRefused(problem)


def sync_weights_waking(url: str, weights_dir: Path, timeout_s: float = 600.0, kv_setting: str = KV_SETTING) -> None:
    """`sync_weights` for a vLLM that `sleep_for_training` put to sleep: wake the weights' memory, reload them in
    place, then, once `wake_fits`, wake the KV cache, which resumes serving (the sleep already emptied the prefix
    cache). Waking the weights alone first keeps the KV cache's memory free while the reload runs. When the KV cache
    does not fit, vLLM stays as it is (VLLMWakeRefused): a wake of every tag would kill its engine core."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0)) as http:
        try:
            _checked(http.post("/wake_up", params={"tags": "weights"}))
            _reload(http, weights_dir)
            wake_fits(url, kv_setting)
            _checked(http.post("/wake_up", params={"tags": "kv_cache"}))
        except VLLMWakeRefused:
            raise
        except BaseException:
            with contextlib.suppress(httpx.HTTPError):
                http.post("/wake_up")  # every tag: serving again rather than asleep for good
            raise


def before_transfer(url: str, *, asleep: bool, timeout_s: float = 600.0) -> None:
    """Before the trainer pushes weights through vLLM's weight-transfer engine: as `sync_weights` and
    `sync_weights_waking` before their reload (running requests finish on the old weights and new ones wait; or,
    asleep, the weights' memory comes back)."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0)) as http:
        if asleep:
            _checked(http.post("/wake_up", params={"tags": "weights"}))
        else:
            _checked(http.post("/pause", params={"mode": "wait"}, timeout=None))


def after_transfer(url: str, *, asleep: bool, timeout_s: float = 600.0, kv_setting: str = KV_SETTING) -> None:
    """After a push: as `sync_weights` and `sync_weights_waking` after their reload (empty the prefix cache and
    resume; or, once `wake_fits`, wake the KV cache, which resumes)."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0)) as http:
        if asleep:
            wake_fits(url, kv_setting)
            _checked(http.post("/wake_up", params={"tags": "kv_cache"}))
        else:
            _reset_prefix_cache(http)
            _checked(http.post("/resume"))


def transfer_abandoned(url: str, *, asleep: bool, timeout_s: float = 60.0) -> None:
    """After a failed push, before the disk sync: a paused vLLM resumes (the disk sync pauses it again, with no lease
    running meanwhile); a waking one stays as it is for `sync_weights_waking`. Best effort."""
    if asleep:
        return
    with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=url, timeout=timeout_s) as http:
        http.post("/resume")


def _reload(http: httpx.Client, weights_dir: Path) -> None:
    """The reload itself, through the worker extension (paths only cross `collective_rpc`: docs/backends.md)."""
    _checked(http.post("/collective_rpc", json={
        "method": "marl_reload_weights", "kwargs": {"weights_path": str(weights_dir)}}))


def _answer(response: httpx.Response) -> dict[str, Any]:
    """A dev route's JSON object ({} when it answered none)."""
    try:
        answer = response.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _checked(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise RuntimeError(f"vLLM {response.request.url.path} answered {response.status_code}: {response.text[:1000]}")
    return response
