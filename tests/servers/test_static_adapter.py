"""`marl serve --static --adapter DIR`: the base model with a PEFT adapter on every call, as `marl eval` plays a
LoRA policy's checkpoint. Real server in this process, real HTTP, a tiny model and a random adapter."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest
import torch
import uvicorn
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from marl.cli import parse
from marl.protocol import ChatCompletionRequest
from marl.runner.launch import ServerProcess, free_port
from servers.entrypoint import ServeOptions, build_server
from servers.http.routes import create_app
from servers.static_server import StaticServer
from tests.conftest import ADMIN

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def adapter_dir(tiny_model, tmp_path_factory) -> Path:
    """A PEFT adapter whose B is random, not zero: it visibly changes the base model's outputs."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    directory = tmp_path_factory.mktemp("adapter")
    get_peft_model(base, config).save_pretrained(directory)
    return directory


class InProcessServer:
    """`marl serve` as `build_server` builds it, uvicorn in a thread (tests/conftest.py's LocalServer, with options)."""

    def __init__(self, options: ServeOptions):
        self.server, token = build_server(options)
        self.url = f"http://127.0.0.1:{options.port}"
        config = uvicorn.Config(create_app(self.server, token), host="127.0.0.1", port=options.port,
                                log_level="warning")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.server.engine is None:  # STATIC once its model (and adapter) loaded
            assert time.monotonic() < deadline and self._thread.is_alive(), "the static server did not boot"
            assert self.server.telemetry.errors.last_error is None, self.server.telemetry.errors.last_error
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=15)


def static_options(model: Path, adapter: Path | None) -> ServeOptions:
    return ServeOptions(model=str(model), port=free_port(), admin_token=ADMIN, static=True, device="cpu",
                        served_model_name="tiny", adapter=adapter)


def greedy_reply(srv: InProcessServer) -> tuple[list[str], list[float]]:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="any")
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                           logprobs=True)
    content = reply.choices[0].logprobs.content
    return [t.token for t in content], [t.logprob for t in content]


def peft_greedy(model: torch.nn.Module, prompt_ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs (log softmax of the raw logits) by a plain forward pass per token."""
    ids, logprobs = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt_ids):], logprobs


def test_a_static_server_serves_its_adapter_as_peft_computes_it(tiny_model, adapter_dir):
    from peft import PeftModel

    with InProcessServer(static_options(tiny_model, adapter_dir)) as srv:
        assert isinstance(srv.server, StaticServer) and srv.server.adapter == adapter_dir
        tokens, logprobs = greedy_reply(srv)
        formatter, context = srv.server.formatter, srv.server.engine.context_length
        prompt_ids = formatter.prompt_ids(ChatCompletionRequest(model="tiny", messages=MESSAGES), [], context)
        eos = srv.server.engine.eos_token_ids
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    plain_ids, plain_logprobs = peft_greedy(base, prompt_ids, len(tokens))
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    ids, expected = peft_greedy(adapted, prompt_ids, len(tokens))
    assert len(tokens) == 6 or ids[len(tokens) - 1] in eos  # greedy: the reply stops where PEFT's does
    assert tokens == [formatter.decode([t]) for t in ids]
    assert logprobs == pytest.approx(expected, abs=1e-4)
    assert logprobs != pytest.approx(plain_logprobs, abs=1e-3) or ids != plain_ids  # the adapter changed something
    with InProcessServer(static_options(tiny_model, None)) as srv:  # and without it: the base model
        assert greedy_reply(srv)[1] == pytest.approx(plain_logprobs, abs=1e-4)


def serve_exit(argv: list[str], capsys) -> tuple[int, str]:
    args = parse(["serve", "--port", "1", *argv])
    with pytest.raises(SystemExit) as info:
        args.func(args)
    return info.value.code, capsys.readouterr().err


def test_adapter_needs_static_and_an_adapter_directory(tiny_model, adapter_dir, tmp_path, capsys):
    code, err = serve_exit(["--model", str(tiny_model), "--adapter", str(adapter_dir)], capsys)
    assert code == 2 and "--adapter serves a LoRA adapter as it is: give --static too" in err
    code, err = serve_exit(["--model", str(tiny_model), "--static", "--adapter", str(tmp_path)], capsys)
    assert code == 2 and f"--adapter {tmp_path}: not a PEFT adapter directory" in err


def test_server_process_passes_the_adapter(tmp_path, adapter_dir):
    proc = ServerProcess(model="base", admin_token="t", data_dir=tmp_path, log_path=tmp_path / "log", static=True,
                         adapter=adapter_dir)
    assert proc.args[proc.args.index("--adapter") + 1] == str(adapter_dir) and "--static" in proc.args
    plain = ServerProcess(model="base", admin_token="t", data_dir=tmp_path, log_path=tmp_path / "log", static=True)
    assert "--adapter" not in plain.args
