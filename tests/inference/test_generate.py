import pytest
import torch

from moe_lit.errors import MoeLitError
from moe_lit.inference import KVCache, generate, stream
from moe_lit.model import Transformer
from tests.helpers.decoding import assert_compiled_decoding_repeats_eager
from tests.helpers.models import tiny


def recompute_greedy(model, prompt, steps, window=None):
    """Today's path: the whole window through the model for every new token."""
    window = window or model.config.seq_len
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens[-window:]])).logits_BLV
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


CONFIGS = {
    "moe": lambda: tiny(n_kv_heads=2, seq_len=24),
    "dense": lambda: tiny(dense=True, n_kv_heads=2, seq_len=24),
    # the HF families' attention options: per-head q/k norm, q/k/v biases, a head dim of its own
    "qwen3-like": lambda: tiny(n_kv_heads=2, seq_len=24, qk_norm="head", qkv_bias=True, attn_head_dim=16),
}


@pytest.fixture(params=list(CONFIGS))
def model(request):
    torch.manual_seed(0)
    return Transformer(CONFIGS[request.param]()).eval()


def test_cached_forward_equals_full_forward_logits(model):
    idx = torch.randint(0, 97, (2, 12))
    full = model(idx).logits_BLV
    cache = KVCache(model.config, 2, 12)
    pieces = [model(idx[:, :5], kv_cache=cache).logits_BLV]
    pieces += [model(idx[:, i : i + 1], kv_cache=cache).logits_BLV for i in range(5, 12)]
    assert cache.length == 12
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)
    assert cache.k_NBGSDh.shape == (2, 2, 2, 12, model.config.head_dim)  # kv heads, not query heads


def test_batched_unequal_prompts_equal_one_row_recompute(model):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42]]
    got = generate(model, prompts, max_new_tokens=10)
    assert got == [recompute_greedy(model, p, 10) for p in prompts]


def test_window_overflow_slides_like_recompute(model):
    prompts = [list(range(1, 21)), [7, 8]]  # 20 + 10 > seq_len 24; a shorter window too
    assert generate(model, prompts, 10) == [recompute_greedy(model, p, 10) for p in prompts]
    assert generate(model, prompts, 6, window=8) == [recompute_greedy(model, p, 6, window=8) for p in prompts]


def test_stop_tokens_and_stop_rule_end_rows_independently(model):
    prompt = [5, 6, 7]
    free = generate(model, [prompt], 8)[0]
    other = [9, 10]
    cut = generate(model, [prompt, other], 8, stop_tokens=[free[3]])
    assert cut == [free[: free.index(free[3])], generate(model, [other], 8, stop_tokens=[free[3]])[0]]
    rule = generate(model, [prompt], 8, stop=lambda out: len(out) == 2)[0]
    assert rule == free[:2]
    steps = list(stream(model, [prompt], 8, stop_tokens=[free[3]]))
    assert [s[0] for s in steps] == free[: free.index(free[3])] + [None]  # the stop step yields None, then ends


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    prompts = [[5, 6, 7], [1, 2]]
    a = generate(model, prompts, 8, temperature=1.0, seed=3)
    assert a == generate(model, prompts, 8, temperature=1.0, seed=3)
    assert a != generate(model, prompts, 8, temperature=1.0, seed=4)
    greedy = generate(model, prompts, 8)
    assert generate(model, prompts, 8, temperature=0.7, top_k=1, seed=1) == greedy
    assert generate(model, prompts, 8, temperature=0.7, top_p=1e-6, seed=1) == greedy


def test_top_p_keeps_the_smallest_nucleus():
    from moe_lit.inference.generate import next_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(next_tokens(logits, 1.0, None, 0.75, torch.Generator().manual_seed(s))) for s in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"window": 99}, "window"),
        ({"prompts": [[]]}, "prompt"),
    ],
)
def test_bad_arguments_name_the_field(model, kwargs, field):
    args = {"prompts": [[1, 2]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(MoeLitError, match=field):
        generate(model, **args)


@torch.no_grad()
def test_a_static_cache_gives_the_dynamic_caches_logits(model):
    idx = torch.randint(0, 97, (2, 12))
    logits = {}
    for static in (False, True):
        cache = KVCache(model.config, 2, 16, static=static)
        pieces = [model(idx[:, :5], kv_cache=cache).logits_BLV]
        pieces += [model(idx[:, i : i + 1], kv_cache=cache).logits_BLV for i in range(5, 12)]
        logits[static] = torch.cat(pieces, dim=1)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_compiled_decoding_gives_the_eager_tokens_with_one_graph_for_all_steps(kind):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Transformer(CONFIGS[kind]()).eval()
    long_prompt = list(range(1, 21))
    past_the_window = recompute_greedy(model, long_prompt, 10)
    frames = assert_compiled_decoding_repeats_eager(model, [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42]], 14)
    # an eager generation of the compiled model, past the window, compiles nothing either
    assert generate(model, [long_prompt], 10) == [past_the_window]
    assert counters["frames"]["ok"] == frames
    # another batch size: its first decode step checks the guards (and compiles), the later ones,
    # which skip them, run that graph, not the 3-row one
    assert generate(model, [[5, 6, 7]], 6, compile=True) == generate(model, [[5, 6, 7]], 6)


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_linears_trace_as_row_sums_with_the_linear_values(bias):
    from moe_lit.inference.generate import RowVectorLinear

    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op.startswith("call_")})
        return gm.forward

    def project(layer, x):
        with RowVectorLinear():
            return layer(x)

    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    traced = torch.compile(project, backend=record, dynamic=False)
    with torch.no_grad():
        for rows in (1, 2):
            x = torch.randn(rows, 1, 24)
            torch.testing.assert_close(traced(layer, x), layer(x), rtol=1e-5, atol=1e-5)
    one_row, two_rows = graphs
    assert not any("linear" in op for op in one_row) and any("sum" in op for op in one_row)
    assert any("linear" in op for op in two_rows)
