"""The command line: a generation runs, and every kind of bad input is one line on stderr, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdecode.cli import main
from tests.test_loading import _fake_entry
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf", "llama").path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        [
            "generate",
            "--model",
            str(tiny_gguf),
            "--prompt",
            "the tea",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    record = json.loads(out)
    assert len(record["token_ids"]) == 5
    assert record["finish_reason"] == "length"
    assert record["stats"]["mean_accepted_length"] == 1.0
    assert record["timing"]["total_s"] > 0


def truncated(tiny_gguf: Path) -> str:
    data = tiny_gguf.read_bytes()
    bad = tiny_gguf.with_name("cut.gguf")
    bad.write_bytes(data[: len(data) // 2])
    return str(bad)


def unsupported(tiny_gguf: Path) -> str:
    return str(write_tiny_gguf(tiny_gguf.with_name("gpt2.gguf"), "llama", declared_arch="gpt2").path)


BAD_INPUTS = [
    # (name, argv after `generate --prompt hi` given a tiny model path, expected words)
    ("unknown model", lambda g: ["--model", "no-such-model"], "unknown model 'no-such-model'"),
    ("missing file", lambda g: ["--model", str(g.with_name("absent.gguf"))], "no such file"),
    ("truncated gguf", lambda g: ["--model", truncated(g)], "cut.gguf"),
    ("unsupported architecture", lambda g: ["--model", unsupported(g)], "unsupported architecture"),
    ("negative temperature", lambda g: ["--model", str(g), "--temperature", "-1"], "temperature"),
    ("top-p above 1", lambda g: ["--model", str(g), "--top-p", "1.5"], "top_p"),
    ("top-p zero", lambda g: ["--model", str(g), "--top-p", "0"], "top_p"),
    ("max tokens zero", lambda g: ["--model", str(g), "--max-tokens", "0"], "max_tokens"),
    ("prompt beyond context", lambda g: ["--model", str(g), "--prompt", "the " * 300], "context"),
]


@pytest.mark.parametrize(("case", "args", "words"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line(
    case, args, words, tiny_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["generate", "--prompt", "hi", *args(tiny_gguf)], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("specdecode: error:")]
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err


def test_bench_runtime_depth_must_be_positive(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench-runtime --depth 0` is refused in one line before any model loads."""
    argv = ["bench-runtime", "--model", str(tiny_gguf), "--depth", "256", "--depth", "0"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "--depth must be >= 1, got 0" in err and "Traceback" not in err


def test_checksum_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _fake_entry(monkeypatch, tmp_path / "wheels", [b"tampered" * 64], "0" * 64)
    code, _, err = run_cli(["models", "fetch", "fake-model"], capsys)
    assert code == 2 and "checksum mismatch" in err


def test_console_script_exit_status(tmp_path: Path) -> None:
    """The installed entry point, in a real process: non-zero status, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "generate", "--model", "nope", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("specdecode: error: unknown model 'nope'")
    assert "Traceback" not in proc.stderr


def test_models_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["models", "list"], capsys)
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == [
        "smollm2-135m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
    ]


def test_spec_bench_categories_may_name_an_mt_bench_sub_category(tmp_path: Path) -> None:
    """`--categories coding` takes MT-Bench's coding questions alone and reports them as coding;
    the other filters keep Spec-Bench's grouping (the sub-categories count as mt_bench)."""
    from specdecode.bench.specbench import category_of, load_questions

    rows = [("coding", 1), ("writing", 2), ("coding", 3), ("translation", 4)]
    path = tmp_path / "q.jsonl"
    lines = [json.dumps({"question_id": i, "category": c, "turns": ["t"]}) for c, i in rows]
    path.write_text("\n".join(lines) + "\n")
    coding = load_questions(path, None, ["coding"])
    assert [q["question_id"] for q in coding] == [1, 3]
    assert {category_of(q) for q in coding} == {"coding"}
    grouped = load_questions(path, None, ["mt_bench", "translation"])
    assert [category_of(q) for q in grouped] == ["mt_bench", "mt_bench", "mt_bench", "translation"]


def test_spec_bench_can_turn_the_load_policy_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`specdecode bench --no-policy` times every step drafting its method's whole proposal;
    `--activations int8` and `--kv-cache-dtype float16` reach the LLM."""
    import argparse

    from specdecode.bench import specbench
    from specdecode.cli import add_activations_arg, add_kv_cache_arg, add_model_args

    made: list[dict[str, object]] = []

    class Stop(Exception):
        pass

    def fake_llm(**kwargs: object) -> None:
        made.append(kwargs)
        raise Stop

    monkeypatch.setattr(specbench, "LLM", fake_llm)
    cases = (([], True), (["--no-policy"], False), (["--activations", "int8"], True))
    for flags, want in (*cases, (["--kv-cache-dtype", "float16"], True)):
        parser = argparse.ArgumentParser()
        add_model_args(parser)
        add_activations_arg(parser)  # as the CLI registers `bench`
        add_kv_cache_arg(parser)
        specbench.add_args(parser)
        with pytest.raises(Stop):
            specbench.main_args(parser.parse_args(["--model", "tiny", "--method", "prompt_lookup", *flags]))
        assert made[-1]["speculation_policy"] is want
        assert made[-1]["activations"] == ("int8" if "int8" in flags else "float32")
        assert made[-1]["kv_cache_dtype"] == ("float16" if "float16" in flags else "auto")


def test_spec_bench_reports_decoding_apart_from_prefill(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specdecode bench` on a tiny model: every output equals plain decoding's, beside the whole
    request's tokens/s each row gives decoding's alone (the tokens after the first over the time
    after the first token), `--plot` draws the speedups, and a first line (kept in the JSON)
    names the kernels that ran and the memory bandwidth read before and after the run."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["a b c a b c a b", "c a b"]}) + "\n"
    )
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--model", str(tiny_gguf), "--questions", str(questions), "--max-tokens", "12"]
    assert main([*argv, "--method", "prompt_lookup", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert "decode" in lines[1] and f"plot written to {png}" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the speedups drawn (matplotlib)
    result = json.loads(out.read_text())
    ran_on = result["machine"]
    assert lines[0].startswith(f"kernels {ran_on['kernels']}")
    assert ran_on["threads"] == torch.get_num_threads()
    if ran_on["read_gb_s"] is not None:  # our CPU kernels' probe: a bandwidth each side of the run
        assert ran_on["read_gb_s"] > 0 and ran_on["read_gb_s_after"] > 0
        assert f"memory read {ran_on['read_gb_s']} GB/s before the run" in lines[0]
    rows = {(r["method"], r["category"]): r for r in result["rows"]}
    for method in ("plain", "prompt_lookup[k=4,n=2]"):
        row = rows[(method, "overall")]
        assert row["greedy_match"] and row["outputs"] == 2
        assert row["decode_tokens_per_s"] > 0 and row["tokens_per_s"] > 0
    assert rows[("plain", "overall")]["decode_speedup"] == 1.0
    # each method's decoding steps by the rows their forward ran: plain's one row each, one a
    # token (the prefill stops before the prompt's last token, the first step's root)
    steps = result["steps"]
    plain_tokens = rows[("plain", "overall")]["tokens"]
    assert [(s["rows"], s["steps"]) for s in steps["plain"]] == [(1, plain_tokens)]
    assert all(s["ms"] > 0 for by_rows in steps.values() for s in by_rows)
    # of each step's time, its target forward: some, never more than the whole step
    assert all(0 < s["forward_ms"] <= s["ms"] for by_rows in steps.values() for s in by_rows)
    assert "decoding steps by rows in their forward" in printed
    one_row = steps["plain"][0]
    assert f"1: {plain_tokens} x {one_row['ms']:.2f} [{one_row['forward_ms']:.2f}]" in printed


def test_spec_bench_repeats_report_medians_of_within_run_ratios(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specdecode bench --repeats N` runs the questions N times and reports, per method and
    category, the median of each run's own figures (a speedup is a ratio within its run), every
    run's overall speedups, outputs counted over all runs, and a match only where every run
    matched; `--repeats 0` is refused."""
    from specdecode.bench.specbench import median_report

    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["a b c a b c a b"]}) + "\n"
    )
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_gguf), "--questions", str(questions), "--max-tokens", "8"]
    assert main([*argv, "--method", "prompt_lookup", "--repeats", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "medians of 3 runs" in printed
    rows = {(r["method"], r["category"]): r for r in json.loads(out.read_text())["rows"]}
    lookup = rows[("prompt_lookup[k=4,n=2]", "overall")]
    assert len(lookup["speedup_runs"]) == 3 and lookup["speedup"] == round(
        sorted(lookup["speedup_runs"])[1], 3
    )
    assert lookup["outputs"] == 3 and lookup["greedy_match"]
    assert main([*argv, "--repeats", "0"]) == 2 and "--repeats must be >= 1" in capsys.readouterr().err

    def one(speedup: float, mismatches: int) -> dict[str, object]:
        row = dict(method="m", category="overall", tokens_per_s=100 * speedup, speedup=speedup, tau=1.5)
        row |= dict(decode_tokens_per_s=None, decode_speedup=None, outputs=2, tokens=10)
        row |= dict(greedy_match=mismatches == 0, mismatches=mismatches)
        steps = {
            "m": [
                {"rows": 1, "steps": 10, "ms": 5.0, "forward_ms": 4.0},
                {"rows": 4, "steps": 2, "ms": 8.0 * speedup, "forward_ms": 6.0 * speedup},
            ]
        }
        return {"temperature": 0.0, "rows": [row], "tie_gaps": {}, "steps": steps}

    report = median_report([one(1.1, 0), one(1.4, 1), one(1.2, 0)])
    # steps summed over the runs, their mean ms (whole, forward) over all of them
    assert report["steps"]["m"] == [
        {"rows": 1, "steps": 30, "ms": 5.0, "forward_ms": 4.0},
        {"rows": 4, "steps": 6, "ms": 9.867, "forward_ms": 7.4},
    ]
    merged = report["rows"][0]
    assert merged["speedup"] == 1.2 and merged["speedup_runs"] == [1.1, 1.4, 1.2]
    assert merged["decode_speedup"] is None and merged["tau"] == 1.5
    assert not merged["greedy_match"] and merged["mismatches"] == 1 and merged["outputs"] == 6


def test_bench_peer_takes_turns_and_reports_medians_of_within_run_ratios(tmp_path: Path) -> None:
    """bench-peer's engines (llama.cpp's need the [peer] extra, not here: stand-ins) take each
    prompt in turn before the next, so a machine slowing down part way slows them alike; over
    repeats each engine's ratio to the first is the median of its within-run ratios; `--plot`
    draws tokens/s per category."""
    from specdecode.bench.peer import plot, run_interleaved, summarize, table

    calls: list[tuple[str, int]] = []
    slow = {"factor": 1.0}

    def engine(name: str, seconds: float) -> tuple[str, object]:
        def decode(ids: list[int]) -> tuple[int, float, str]:
            calls.append((name, ids[0]))
            if len(calls) == 7:  # the machine halves its speed from the 7th call on
                slow["factor"] = 2.0
            return 10, seconds * slow["factor"], f"text {ids[0]}"

        return name, decode

    engines = [engine("llama.cpp plain", 1.0), engine("specdecode plain", 0.5)]
    prompts = [("qa", [1]), ("rag", [2]), ("qa", [3])]
    rounds = run_interleaved(engines, prompts, repeats=3)  # type: ignore[arg-type]
    assert [n for n, _ in calls[:4]] == ["llama.cpp plain", "specdecode plain"] * 2
    assert [i for _, i in calls[:6]] == [1, 1, 2, 2, 3, 3]
    summaries = summarize(rounds, ["qa", "rag"])
    ours = summaries[1]
    assert ours.ratio_runs == [2.0, 2.0, 2.0]  # each run's ratio, whatever its speed
    assert ours.ratio == 2.0 and ours.same_text == 3 and ours.outputs == 3
    assert ours.rate == 10.0 and summaries[0].rate_by_category["qa"] == 5.0  # medians: 2 of 3 runs slow
    assert "medians of 3 runs" in table(summaries, ["qa", "rag"])
    png = tmp_path / "peer.png"
    plot(summaries, ["qa", "rag"], str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_peer_explains_a_llama_cpp_build_this_cpu_cannot_run(tmp_path: Path) -> None:
    """bench-peer runs the GGUF in llama.cpp in a child process first, over the warm-up prompt
    and one token after it with the run's threads: a build for instructions the CPU lacks dies
    (SIGILL on one Xeon; SIGSEGV on another once a prompt had two tokens), which in-process would
    kill the benchmark unexplained; it gets a clear error saying how to rebuild, and a load that
    fails otherwise, or hangs, names the failure. (Stand-in child processes: llama.cpp is an
    optional extra.)"""
    from specdecode.bench.peer import PROBE, check_llama_runs
    from specdecode.errors import SpecDecodeError

    model = tmp_path / "m.gguf"
    ids = [1, 9690, 28]
    for sig in ("SIGILL", "SIGSEGV"):
        dies = "import os, signal; print({path!r}); os.kill(os.getpid(), signal.SIG)".replace("SIG", sig)
        with pytest.raises(SpecDecodeError, match=rf"died of {sig} running m\.gguf.*GGML_NATIVE=OFF"):
            check_llama_runs(model, ids, 2, dies)
    fails = "import sys; sys.exit('failed to load model from ' + {path!r})"
    with pytest.raises(SpecDecodeError, match=r"could not load m\.gguf: failed to load model from .*m\.gguf"):
        check_llama_runs(model, ids, 2, fails)
    with pytest.raises(SpecDecodeError, match=r"took over 0.5 s to run m\.gguf"):
        check_llama_runs(model, ids, 2, "import time; time.sleep(30)", timeout=0.5)
    # runs: no error; the child gets the prompt and the threads
    runs = "assert {path!r}.endswith('m.gguf') and {ids!r} == [1, 9690, 28] and {threads} == 2"
    check_llama_runs(model, ids, 2, runs)
    with pytest.raises(SpecDecodeError, match="could not load"):
        check_llama_runs(model, ids, 3, "assert {threads} == 2")
    # the real probe: the whole prompt, then a token after it, with the benchmark's threads
    code = PROBE.format(path=str(model), ids=ids, threads=2)
    compile(code, "probe", "exec")
    assert "m.eval([1, 9690, 28])" in code and "n_threads=2" in code and "m.eval([m.sample(" in code
