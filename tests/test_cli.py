"""The `rackserve` command: its subcommand registry, and `generate` and `chat` end to end in a
subprocess on a tiny random Llama, checked against the offline LLM API in this process.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from rackserve.serve import cli


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> list[str]:
    """Engine flags for the tiny Llama (its tokenizer sits beside it)."""
    return ["--model", tiny_llama_dir, "--device", "cpu", "--num-gpu-blocks-override", "64"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from rackserve import LLM
    with LLM(tiny_llama_dir, device="cpu", num_gpu_blocks_override=64) as llm:
        yield llm


def rackserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rackserve.serve.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_registry_nests_multi_word_commands(monkeypatch):
    seen = []

    def add_args(parser):
        parser.add_argument("--rounds", type=int, default=1)

    def run(args):
        seen.append(args.rounds)
        return 3

    monkeypatch.setitem(cli.SUBCOMMANDS, "bench demo", cli.Subcommand("bench demo", "a demo", add_args, run))
    assert cli.main(["bench", "demo", "--rounds", "5"]) == 3
    assert seen == [5]
    with pytest.raises(SystemExit):
        cli.main(["bench"])           # a group alone is not a command


def test_generate_prints_the_offline_completion(tiny, llm):
    from rackserve import SamplingParams
    expected = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=8,
                                                                    ignore_eos=True))[0]
    done = rackserve("generate", *tiny, "--prompt", "The quick brown fox", "--max-tokens", "8",
                     "--temperature", "0", "--ignore-eos")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.outputs[0].text + "\n"
    assert "8 generated" in done.stderr and "finish_reason=length" in done.stderr


def test_generate_chat_uses_the_chat_template(tiny, llm):
    from rackserve import SamplingParams
    messages = [{"role": "user", "content": "Hello there"}]
    expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    done = rackserve("generate", *tiny, "--prompt", "Hello there", "--chat", "--max-tokens", "6",
                     "--temperature", "0", "--ignore-eos")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.outputs[0].text + "\n"


def test_generate_rejects_bad_sampling_values(tiny):
    done = rackserve("generate", *tiny, "--prompt", "x", "--top-p", "0")
    assert done.returncode == 2 and "top_p" in done.stderr


def test_chat_streams_replies_and_keeps_the_history(tiny, llm):
    from rackserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    history = [{"role": "user", "content": "Hello"}]
    first = llm.chat(history, params)[0].outputs[0].text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = llm.chat(history, params)[0].outputs[0].text
    done = rackserve("chat", *tiny, "--max-tokens", "6", "--temperature", "0", "--ignore-eos",
                     stdin="Hello\nAnd then?\n/exit\n")
    assert done.returncode == 0, done.stderr
    # Each reply is printed after the prompt that asked for it; the second saw the first.
    after_first = done.stdout.index("> " + first) + 2 + len(first)
    assert done.stdout.index("> " + second, after_first) > 0
