"""`rackserve bench prefix-replay` on a tiny DeepSeek-V4: a cached prefix costs a bounded replay, not
the prefix (computed tokens, not time: tests pin behaviour); its KV bytes table against DeepSeek-V3;
a model with one cache group is refused."""
import json

import torch

from rackserve.bench.prefix_replay import run_prefix_replay  # noqa: F401  (registers the command)
from rackserve.serve.cli import main
from tests.tiny_models import TINY_KV_CACHE_GIB, build_tiny_deepseek_v4
from tests.tokenizer_utils import save_test_tokenizer


def test_a_cached_prefix_costs_a_bounded_replay_and_fewer_kv_bytes_than_deepseek_v3(tmp_path):
    model = build_tiny_deepseek_v4(tmp_path / "v4", seed=3)
    save_test_tokenizer(model, 512)
    out = tmp_path / "replay.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["bench", "prefix-replay", "--model", model, "--dtype", "float32", "--device", "cpu",
                     "--prefix-lens", "80,160", "--new-tokens", "8", "--repeats", "1", "--output", str(out),
                     "--kv-cache-memory", str(TINY_KV_CACHE_GIB)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    # 4 layers of 16-token windows: 4 x 15 tokens before the hit, rounded out to 16-token blocks.
    depth = result["replay"]["num_layers"] * (result["replay"]["window"] - 1)
    for row in result["rows"]:
        hit, full = row["bounded_replay"], row["full_recompute"]
        assert full["computed_tokens"] == row["prompt_tokens"]
        assert 0 < row["replayed_tokens"] <= depth + 16
        assert hit["computed_tokens"] == row["replayed_tokens"] + 8
    # The replay does not grow with the prefix.
    assert result["rows"][0]["replayed_tokens"] == result["rows"][1]["replayed_tokens"]
    table = result["kv_bytes"]
    # Per token and layer: V3 caches 576 values; V4's CSA layers (32 + 16) / 4, its HCA layer 32 / 16.
    assert table["v3_bytes_per_token"] == 4 * 576 * 4
    assert table["v4_bytes_per_token_long_context"] == 4 * (2 * 48 / 4 + 32 / 16)
    assert table["held_per_request"]["131072"]["v4"] < table["held_per_request"]["131072"]["v3"] / 50


def test_a_model_with_one_cache_group_is_refused(tiny_llama_dir, capsys):
    assert main(["bench", "prefix-replay", "--model", tiny_llama_dir, "--dtype", "float32", "--device", "cpu",
                 "--prefix-lens", "32", "--repeats", "1", "--kv-cache-memory", str(TINY_KV_CACHE_GIB)]) == 2
    assert "one KV cache group" in capsys.readouterr().err
