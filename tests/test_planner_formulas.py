"""The planner's formulas against the papers' own numbers (ZeRO, Narayanan, Korthikanti) and
against what autograd saves; its step-time terms and layout rules. No rank runs here."""
import pytest
import torch

from planner import hardware as H
from planner import published as pub
from planner.layout import Layout, enumerate_layouts, why_not
from planner.memory import layer_activation_bytes, memory, torch_head_bytes, torch_layer_activation_bytes
from planner.model import PRESETS, Model, gpt
from planner.steptime import Software, step_time
from zero_from_scratch.engine.ledger import model_state_bytes


def test_zero_paper_figure1_exactly():
    """ZeRO Figure 1: Ψ = 7.5 B, N = 64, K = 12 → 120 / 31.4 / 16.6 / 1.9 GB per device."""
    psi, n = int(pub.ZERO_FIG1["psi"]), pub.ZERO_FIG1["n"]
    for stage, gb in pub.ZERO_FIG1["GB"].items():
        got = sum(model_state_bytes(stage, psi, n, mixed=True).values()) / 1e9
        assert round(float(got), 1) == gb, (stage, float(got), gb)


def test_planner_states_are_the_ledger_formula():
    """A 7.5 B-parameter shape on 64 GPUs, tp = pp = 1: the planner's model states are 16Ψ, 4Ψ + 12Ψ/N, ..."""
    m = Model("z", 1, 4096, 32, 8, 16, ffn=4096, bias=False)
    hw = H.A100
    for stage, k in ((0, 16), (3, 16 / 64)):
        mem = memory(m, 16, Layout(64, 1, 1, zero=stage), 64, hw)
        assert mem["params"] + mem["grads"] + mem["optimizer"] == pytest.approx(k * m.params(), rel=1e-9)


def test_gpt_flops_are_narayanan_eq3():
    m = PRESETS["gpt-1t"]
    B, s, L, h, V = 1, m.seq, m.layers, m.hidden, m.vocab
    paper = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert m.flops_per_token(s, recompute_layers=True) * s == pytest.approx(paper, rel=1e-12)
    model_flops = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert m.flops_per_token(s) * s == pytest.approx(model_flops, rel=1e-12)


def test_parameter_counts():
    assert PRESETS["llama-7b"].params() == 6_738_415_616          # Llama-2-7b's published count
    assert abs(PRESETS["gpt-1t"].params() / 1e9 - 1008.0) < 1.0   # Narayanan Table 1: 1008.0 B
    assert abs(PRESETS["gpt-530b"].params() / 1e9 - 529.6) < 0.5


def test_korthikanti_activations():
    """sbh(34 + 5as/h) without parallelism; selective drops the 5as/h term; full keeps 2sbh; /t with sp."""
    m = gpt("g", 2, 1024, 16, seq=2048)
    s, h, a = 2048, 1024, 16
    lay = Layout(1, 1, 1, mb=1)
    assert layer_activation_bytes(m, s, lay, 2) == s * h * (34 + 5 * a * s / h)
    assert layer_activation_bytes(m, s, Layout(1, 4, 1, recompute="selective", sp=True), 2) == s * h * 34 / 4
    assert layer_activation_bytes(m, s, Layout(1, 4, 1, recompute="full", sp=True), 2) == 2 * s * h / 4


def _saved_float_bytes(fn, params) -> int:
    """Bytes of the distinct floating-point storages autograd saves while fn runs, parameters
    excluded (they are model states, not activations)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if t.is_floating_point() and st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("h,a,f,s,b", [(256, 4, 1024, 128, 4), (96, 3, 200, 24, 2)])
def test_torch_activation_formula_is_what_autograd_saves(h, a, f, s, b):
    """cpu-here's activation family, 4·s·b·(8h + f + a + 4) per layer and the top's
    4·s·b·(2h + 2 + V) + 4, against the saved tensors of torch's own layers in fp32 (counted by
    saved_tensors_hooks: load-independent, exact)."""
    torch.manual_seed(0)
    m = Model("t", 1, h, a, 50, s, ffn=f)
    lay = Layout(1, 1, 1, mb=b)
    layer = torch.nn.TransformerEncoderLayer(h, a, f, dropout=0.0, batch_first=True, norm_first=True)
    x = torch.randn(b, s, h, requires_grad=True)
    assert _saved_float_bytes(lambda: layer(x), layer.parameters()) == torch_layer_activation_bytes(m, s, lay)
    norm, emb = torch.nn.LayerNorm(h), torch.nn.Embedding(m.vocab, h)
    tgt = torch.randint(0, m.vocab, (b, s))
    head = lambda: torch.nn.functional.cross_entropy((norm(x) @ emb.weight.t()).flatten(0, 1), tgt.flatten())  # noqa: E731
    assert _saved_float_bytes(head, [*norm.parameters(), *emb.parameters()]) == torch_head_bytes(m, s, lay)[0]


@pytest.mark.parametrize("h,a,kv,f,s,b", [(128, 4, 2, 300, 32, 3), (64, 4, 4, 176, 16, 1)])
def test_llama_activation_formula_is_what_autograd_saves(h, a, kv, f, s, b):
    """The llama pipeline presets' family, HF's LlamaDecoderLayer at SDPA in fp32,
    4·(s·b·(8h + 4f + 2·kv·d + a + 2) + 2·s·d) per layer, and its top (RMSNorm, untied head, HF's
    shifted loss), against the saved tensors autograd keeps (exact)."""
    from pipeline_parallel.models.llama import llama_layers, llama_loss, llama_model
    from planner.model import llama
    net = llama_model("small", hidden_size=h, num_attention_heads=a, num_key_value_heads=kv, intermediate_size=f,
                      num_hidden_layers=1, vocab_size=50).train()
    m, lay = llama("t", 1, h, a, f, kv_heads=kv, vocab=50, seq=s), Layout(1, 1, 1, mb=b)
    _, block, norm, head = llama_layers(net)
    x = torch.randn(b, s, h, requires_grad=True)
    assert _saved_float_bytes(lambda: block(x), block.parameters()) == torch_layer_activation_bytes(m, s, lay)
    tgt = torch.randint(0, 50, (b, s))
    top = lambda: llama_loss(head(norm(x)), tgt)  # noqa: E731
    assert _saved_float_bytes(top, [*norm.parameters(), *head.parameters()]) == torch_head_bytes(m, s, lay)[0]


def test_distilbert_activation_formula_is_what_autograd_saves():
    """DistilBERT's eager block (post-norm, GELU, the s×s softmax kept), 4·s·b·(8h + 2f + 4 + a·s)
    at t = 1, against the saved tensors autograd keeps (exact)."""
    from benchmarks.planner_ranks_tp import DistilLM, distilbert_planner_model
    m = distilbert_planner_model("d", 1, 96, 3, 50, 24)
    net, lay = DistilLM(m).train(), Layout(1, 1, 1, mb=3)
    assert sum(p.numel() for p in net.parameters()) == m.params()
    block = net.db.transformer.layer[0]
    x = torch.randn(3, 24, 96, requires_grad=True)
    assert _saved_float_bytes(lambda: block(x, attn_mask=None), block.parameters()) == torch_layer_activation_bytes(m, 24, lay)


def test_cpu_here_uses_the_torch_family_and_gpus_megatrons():
    m, lay = PRESETS["tiny"], Layout(1, 1, 1, mb=2)
    assert H.load("cpu-here").activations == "torch-eager-fp32" and H.A100.activations == "megatron-16bit"
    cpu = memory(m, 32, lay, 2, H.load("cpu-here"))
    per_layer = torch_layer_activation_bytes(m, 32, lay)
    assert cpu["activations"] == pytest.approx(m.layers * per_layer + torch_head_bytes(m, 32, lay)[0])


def test_bubble_and_terms_add_up():
    m = PRESETS["gpt-39b"]
    sw = Software(False, False, False)
    t1 = step_time(m, m.seq, Layout(32, 8, 2, mb=1), 1536, H.A100, sw)
    t2 = step_time(m, m.seq, Layout(32, 8, 2, mb=1, v=4), 1536, H.A100, sw)
    assert t2["bubble"] < t1["bubble"]          # interleaving divides the fill by v
    for t in (t1, t2):
        parts = sum(v for k, v in t.items() if k in ("matmul", "elementwise", "tp comm", "pp comm", "bubble", "dp comm", "optimizer"))
        assert parts == pytest.approx(t["total"])


def test_layout_rules():
    m = PRESETS["llama-70b"]
    assert "kv heads" in why_not(m, Layout(32, 16, 1), 512, 16, 64)
    assert "ZeRO-2/3" in why_not(m, Layout(64, 8, 2, zero=3), 1024, 8, 64)
    assert why_not(m, Layout(64, 8, 1, zero=3), 512, 8, 64) == ""
    lays = list(enumerate_layouts(PRESETS["tiny"], 4, 4, 8))
    assert lays and all(why_not(PRESETS["tiny"], x, 4, 4, 8) == "" for x in lays)


def test_more_memory_saving_never_costs_memory():
    m, hw = PRESETS["llama-13b"], H.A100
    mems = [memory(m, 4096, Layout(64, 1, 1, zero=z, recompute="full"), 128, hw)["total"] for z in range(4)]
    assert mems == sorted(mems, reverse=True)
