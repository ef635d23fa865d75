"""`pagedserve` command line: flags to configs, sizes, errors, and one-shot generation."""

from __future__ import annotations

import argparse
import socket

import pytest

from pagedserve.cli import build_parser, main, parse_size, serve_config_from_args


def test_parse_size() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("200MiB") == 200 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("2gib") == 2 << 30
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_serve_flags_map_one_to_one() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "/models/m",
            "--port",
            "9000",
            "--num-replicas",
            "3",
            "--routing",
            "pow2",
            "--api-key",
            "k",
            "--max-waiting-requests",
            "5",
            "--max-model-len",
            "2048",
            "--kv-cache-memory",
            "1GiB",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "64",
            "--preemption-mode",
            "swap",
            "--dtype",
            "bfloat16",
            "--max-body-bytes",
            "1MiB",
            "--body-timeout-s",
            "5",
            "--max-n",
            "4",
            "--max-logprobs",
            "3",
            "--max-output-tokens",
            "100",
            "--max-prompt-tokens",
            "1000",
            "--disable-hybrid-kv-cache-manager",
        ]
    )
    config = serve_config_from_args(args)
    limits = (config.max_body_bytes, config.body_timeout_s, config.max_n, config.max_logprobs)
    assert limits == (1 << 20, 5.0, 4, 3)
    assert (config.max_output_tokens, config.max_prompt_tokens) == (100, 1000)
    assert config.engine.cache.disable_hybrid_kv_cache_manager
    assert (config.host, config.port, config.num_replicas, config.routing, config.api_key) == (
        "127.0.0.1",
        9000,
        3,
        "pow2",
        "k",
    )
    assert config.max_waiting_requests == 5 and config.address is None
    e = config.engine
    assert (e.model.model, e.model.max_model_len, e.model.dtype) == ("/models/m", 2048, "bfloat16")
    assert (e.cache.kv_cache_memory, e.cache.enable_prefix_caching) == (1 << 30, False)
    assert (e.scheduler.max_num_seqs, e.scheduler.preemption_mode) == (64, "swap")


def test_defaults_come_from_the_dataclasses() -> None:
    config = serve_config_from_args(build_parser().parse_args(["serve", "--api-key", ""]))
    assert (config.host, config.port, config.num_replicas, config.routing) == ("127.0.0.1", 8000, 1, "prefix")
    assert config.engine.cache.enable_prefix_caching is True and config.engine.model.model is None


def test_proxy_location_is_direct_on_the_private_ray_and_every_node_on_a_joined_one() -> None:
    parse = build_parser().parse_args
    assert serve_config_from_args(parse(["serve"])).proxy_location == "Direct"
    assert serve_config_from_args(parse(["serve", "--address", "auto"])).proxy_location == "EveryNode"
    flags = ["serve", "--proxy-location", "HeadOnly"]
    assert serve_config_from_args(parse(flags)).proxy_location == "HeadOnly"


def test_direct_with_a_joined_cluster_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--proxy-location", "Direct", "--address", "auto"]) == 2
    assert "--proxy-location Direct needs the private Ray" in capsys.readouterr().err


def test_a_taken_port_exits_2_before_starting_ray(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    error = capsys.readouterr().err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)" in error


def test_bad_config_exits_2_before_starting_ray(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size must be >= 1" in capsys.readouterr().err
    assert main(["generate", "-p", "hi", "--temperature", "-1"]) == 2


@pytest.mark.slow
def test_generate_prints_the_greedy_text(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve import LLM, SamplingParams

    flags = ["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--dtype", "float32"]
    assert main(["generate", "-p", "The capital of France is", "--max-tokens", "8", *flags]) == 0
    printed = capsys.readouterr().out
    llm = LLM(max_model_len=256, kv_cache_memory=64 << 20, dtype="float32")
    expected = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    assert printed == expected.outputs[0].text + "\n"


def test_generate_with_beam_search_prints_the_best_beams(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve import LLM, BeamSearchParams

    flags = ["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--dtype", "float32",
             "--max-beam-width", "4"]  # fmt: skip
    argv = ["generate", "-p", "The capital of France is", "--max-tokens", "8", "--beam-width", "3", "-n", "2"]
    assert main([*argv, *flags]) == 0
    printed = capsys.readouterr().out
    llm = LLM(max_model_len=256, kv_cache_memory=64 << 20, dtype="float32")
    [beams] = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=3, max_tokens=8))
    prompt_len = len(llm.get_tokenizer()("The capital of France is").input_ids)
    tok = llm.get_tokenizer()
    texts = [tok.decode(s.tokens[prompt_len:], skip_special_tokens=True) for s in beams.sequences[:2]]
    assert printed == "".join(t + "\n" for t in texts)
    assert main([*argv[:-4], "--beam-width", "5", *flags]) == 2  # above --max-beam-width 4
    assert "--max-beam-width 4" in capsys.readouterr().err


def test_an_unsupported_architecture_is_refused_before_anything_starts(tmp_path, capsys, smollm2_dir) -> None:
    import json
    import shutil

    from pagedserve.worker.models import MODEL_REGISTRY

    folder = tmp_path / "gpt2"
    shutil.copytree(smollm2_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["serve", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and all(arch in err for arch in MODEL_REGISTRY)
