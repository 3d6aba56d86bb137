"""The drafter's shapes, its training-time test against chain drafting, and the draft vocab."""

from typing import Callable

import torch

import pytest

from eagle3d.drafter import loss as loss_mod
from eagle3d.drafter.loss import soft_cross_entropy, teacher
from eagle3d.drafter.model import (DraftConfig, Eagle3Drafter, dense_attention, ttt_attention,
                                   with_drafts)
from eagle3d.drafter.vocab import from_counts

TINY = DraftConfig(hidden_size=32, target_hidden_size=24, intermediate_size=64,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                   max_position_embeddings=256, vocab_size=50, draft_vocab_size=20,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def tiny_model() -> Eagle3Drafter:
    torch.manual_seed(0)
    return Eagle3Drafter(TINY, torch.randn(50, 32)).eval()


def test_the_teacher_refuses_targets_off_the_host():
    """Reading them back from the GPU would make every training step wait for the last."""
    with pytest.raises(ValueError, match="on the host"):
        teacher(torch.randn(1, 12, 16), torch.ones(1, 12, dtype=torch.bool, device="meta"),
                torch.randn(20, 16), 3)


def test_shapes_and_loss_counts_only_masked_positions():
    model = tiny_model()
    ids, aux = torch.randint(0, 50, (2, 12)), torch.randn(2, 12, 72)
    outs = model.unroll(ids, aux, 3)
    assert [tuple(o.shape) for o in outs] == [(2, 12, 32)] * 3
    assert tuple(model.logits(outs[0]).shape) == (2, 12, 20)
    last, head = torch.randn(2, 12, 16), torch.randn(20, 16)
    targets = torch.zeros(2, 12, dtype=torch.bool)
    targets[0, 5] = True  # one counted teacher: index 5 is learnt by step 0 at 4, step 2 at 2
    taught = teacher(last, targets, head, 3)
    assert [(p.batch.tolist(), p.index.tolist()) for p in taught.picks] == [
        ([0], [4]), ([0], [3]), ([0], [2])]
    loss, per_step, correct, counted = model(ids, aux, taught, 3)
    assert counted.tolist() == [1, 1, 1]
    targets[1, 0] = True  # index 0 has no earlier index to learn it from
    assert model(ids, aux, teacher(last, targets, head, 3), 3)[3].tolist() == [1, 1, 1]
    loss.backward()
    only_index_1 = torch.zeros(2, 12, dtype=torch.bool)
    only_index_1[1, 1] = True  # only step 0 can learn it: the later steps have nothing
    loss, _, _, counted = model(ids, aux, teacher(last, only_index_1, head, 3), 3)
    assert counted.tolist() == [1, 0, 0]
    loss.backward()
    assert model.fc.weight.grad is not None and model.embed_tokens.grad is None
    assert "embed_tokens" not in model.state_dict()


def test_a_batch_with_nothing_to_learn_gives_every_weight_a_zero_gradient():
    """A rank's filler batch (drafter/data.py): DDP needs a gradient for every weight from every
    rank, and the filler's must add nothing."""
    model = tiny_model()
    ids, aux = torch.randint(0, 50, (1, 12)), torch.randn(1, 12, 72)
    nothing = torch.zeros(1, 12, dtype=torch.bool)
    loss, _, correct, counted = model(ids, aux, teacher(torch.randn(1, 12, 16), nothing,
                                                        torch.randn(20, 16), 3), 3)
    loss.backward()
    assert loss.item() == 0.0 and counted.tolist() == correct.tolist() == [0, 0, 0]
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)


def test_training_time_test_sees_what_chain_drafting_sees():
    """Step k at index t of the unrolled training must equal drafting k tokens after index t
    from the prefix alone: same masks, same positions, nothing from the future."""
    model = tiny_model()
    T, steps = 16, 4
    ids, aux = torch.randint(0, 50, (1, T)), torch.randn(1, T, 72)
    with torch.no_grad():
        outs = model.unroll(ids, aux, steps)
        for t in (0, 5, 10):
            # Real positions 0..t only; the tokens they read are 1..t+1.
            out, context = model.step(ids[:, 1:t + 2], model.fc(aux[:, :t + 1]),
                                      torch.arange(t + 1)[None], None, None)
            feature, drafts = out[:, -1:], []
            torch.testing.assert_close(feature[0, 0], outs[0][0, t], atol=1e-5, rtol=1e-5)
            for k in range(1, steps):
                if t + 1 + k >= T:
                    break
                feature, kv = model.step(ids[:, t + 1 + k:t + 2 + k], feature,
                                         torch.tensor([[t + k]]), context, drafts)
                drafts.append(kv)
                torch.testing.assert_close(feature[0, 0], outs[k][0, t], atol=1e-5, rtol=1e-5)


def test_the_unroll_learns_as_if_every_step_projected_its_own_tokens():
    """The unroll projects the tokens once and moves them by k for step k; the gradients must be
    those of projecting each step's tokens anew, as a chain of single steps does."""
    T, steps = 14, 4
    ids, aux = torch.randint(0, 50, (2, T)), torch.randn(2, T, 72)
    targets = torch.rand(2, T) < 0.7
    taught = teacher(torch.randn(2, T, 16), targets, torch.randn(20, 16), steps)

    def grads(outs: list[torch.Tensor], model: Eagle3Drafter) -> dict[str, torch.Tensor]:
        loss = sum(model.logits(o[p.batch, p.index]).logsumexp(-1).sum() * (k + 1)
                   for k, (o, p) in enumerate(zip(outs, taught.picks)))
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    model = tiny_model()
    positions = torch.arange(T).expand(2, T)
    hidden, context, drafts, outs = model.fc(aux), None, [], []
    for k in range(steps):
        hidden, kv = model.step(torch.nn.functional.pad(ids[:, 1 + k:], (0, 1 + k)), hidden,
                                positions + k, context, None if k == 0 else drafts)
        context, drafts = (kv, drafts) if k == 0 else (context, [*drafts, kv])
        outs.append(hidden)
    want = grads(outs, model)
    got = grads(model.unroll(ids, aux, steps), model)
    assert want["midlayer.self_attn.qkv_tokens.weight"].any()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_served_projections_compute_the_models_q_k_and_v():
    """SGLang reads q_proj, k_proj and v_proj on [normed embedding ; normed hidden]; the model
    holds one projection per half. The served weights must give the model's q, k and v."""
    model = tiny_model()
    layer, served = model.midlayer, model.served_weights()
    embeds, hidden = torch.randn(3, 32), torch.randn(3, 32)
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
    with torch.no_grad():
        ours = layer.tokens(embeds) + layer.self_attn.qkv_hidden(layer.hidden_norm(hidden))
        theirs = torch.cat([x @ served[f"midlayer.self_attn.{p}_proj.weight"].T for p in "qkv"],
                           dim=-1)
    torch.testing.assert_close(ours, theirs)
    assert tuple(served["midlayer.self_attn.q_proj.weight"].shape) == (32, 64)
    again = Eagle3Drafter(TINY, model.embed_tokens)
    again.load_served_weights(served)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                  model.state_dict().values()))


def _attention_inputs(drafts: int, T: int, Tc: int, grad: bool = False, B: int = 2):
    heads, kv_heads, D = 4, 2, 16
    q = torch.randn(B, heads, T, D, requires_grad=grad)
    context, *others = [(torch.randn(B, kv_heads, n, D, requires_grad=grad),
                         torch.randn(B, kv_heads, n, D, requires_grad=grad))
                        for n in (Tc, *[T] * drafts)]
    return q, context, others


def _context_log_sum_exp(q, context, scale, key_mask):
    keys = context[0].repeat_interleave(q.shape[1] // context[0].shape[1], 1)
    T, Tc = q.shape[2], keys.shape[2]
    visible = (torch.arange(Tc)[None, :] <= torch.arange(Tc - T, Tc)[:, None]) & \
        key_mask[:, None, None, :]
    return (q @ keys.transpose(-1, -2) * scale).masked_fill(~visible, -torch.inf).logsumexp(-1)


@pytest.mark.parametrize("drafts", [1, 4])
def test_drafts_merged_into_the_context_attention_give_one_softmax_and_its_gradient(drafts):
    """Training attends to the context alone (a fused kernel) and merges the drafts' keys in
    through its log-sum-exp: the result and every gradient must be those of one softmax over
    all the keys (dense_attention), also where a batch row hides context keys and the context
    is longer than the queries."""
    torch.manual_seed(drafts)
    q, context, others = _attention_inputs(drafts, T=5, Tc=9, grad=True)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[1, :3] = False
    alone = dense_attention(q, context, [], 0.25, key_mask)
    merged = with_drafts(q, alone, _context_log_sum_exp(q, context, 0.25, key_mask), others,
                         0.25)
    want = dense_attention(q, context, others, 0.25, key_mask)
    torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-4)
    leaves = [q, *context, *[t for kv in others for t in kv]]
    g = torch.randn_like(want)
    for got, expected in zip(torch.autograd.grad(merged, leaves, g),
                             torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


class _Graphs:
    """A compiler backend that counts the graphs it is given and records, for every tensor
    they take, which of its sizes were left symbolic."""

    def __init__(self) -> None:
        self.count, self.symbolic = 0, []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.count += 1
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                self.symbolic.append(tuple(not isinstance(n, int) for n in value.shape))
        return gm.forward


def test_the_merge_compiles_once_for_any_number_of_drafts_rows_and_length(monkeypatch):
    """On CUDA every fused kernel is compiled, tens of seconds each on an H200: a TTT-7 trainer
    merges 1 to 6 drafts into batches whose rows and lengths change at every step, and a
    kernel compiled per draft count (or per size it first saw) kept it from its first step for
    minutes. Compiled here by the real compiler on the CPU, each of the merge's kernels (and the
    one folding the log-sum-exp's gradient into the attention's backward) must
    make one graph, forward and backward, whatever the drafts, rows and lengths; and in it the
    feature sizes stay fixed (reductions over a known size ran 6.5% faster on an H200)."""
    import torch.fx.experimental._config as shapes

    from eagle3d.drafter import model
    from eagle3d.drafter.fusion import compiled_for_any_sizes
    graphs = {}
    with shapes.patch(use_duck_shape=shapes.use_duck_shape):  # the process's, restored after
        torch._dynamo.reset()
        for name in ("_join_draft", "_context_grads", "_draft_grads", "_fold_lse_grad"):
            graphs[name] = _Graphs()
            monkeypatch.setattr(model, name, compiled_for_any_sizes(
                getattr(model, name).__wrapped__, backend=graphs[name]))
        for rows, T, drafts in [(2, 5, 1), (2, 5, 2), (3, 9, 4), (2, 7, 6), (5, 6, 3)]:
            q, context, others = _attention_inputs(drafts, T=T, Tc=T, grad=True, B=rows)
            ttt_attention(q, context, others, 0.25).sum().backward()
        torch._dynamo.reset()
    assert {name: g.count for name, g in graphs.items()} == dict.fromkeys(graphs, 1)
    for name, g in graphs.items():
        batched = [s for s in g.symbolic if len(s) >= 4]
        assert batched and all(s[0] and s[-2] and not s[-1] for s in batched), (name, g.symbolic)


@pytest.mark.parametrize("drafts", [0, 1, 4])
def test_fused_training_attention_and_its_gradients_equal_the_dense_ones(drafts):
    """The training kernel (the fused causal kernel over the context, the drafts merged in
    through its log-sum-exp, whose gradient its backward takes folded into the output) against
    one softmax over the dense scores, with grouped KV heads; on CPU PyTorch's own flash kernel
    stands in for cuDNN's, and both backwards read the output only for rowsum(dO * O)."""
    torch.manual_seed(drafts)
    q, context, others = _attention_inputs(drafts, T=150, Tc=150, grad=True)
    got = ttt_attention(q, context, others, 0.25)
    want = dense_attention(q, context, others, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    leaves = [q, *context, *[t for kv in others for t in kv]]
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_soft_cross_entropy_its_gradient_and_its_agreement_count_equal_the_plain_formulas(
        monkeypatch):
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 3 * 50)  # 3 rows per chunk: 4 chunks
    torch.manual_seed(0)
    z = torch.randn(10, 50, requires_grad=True)
    teacher_logits = torch.randn(16, 50)
    rows = torch.tensor([0, 3, 3, 7, 8, 9, 10, 11, 14, 15])
    with torch.no_grad():
        z[[1, 4]] = teacher_logits[rows[[1, 4]]]  # two rows agree with the teacher for sure
    fused, hits = soft_cross_entropy(z, torch.log_softmax(teacher_logits, -1), rows)
    (grad,) = torch.autograd.grad(fused * 2.0, z)
    p = torch.softmax(teacher_logits[rows], -1)
    plain = -(p * torch.log_softmax(z, -1)).sum()
    (want,) = torch.autograd.grad(plain * 2.0, z)
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(grad, want)
    agree = (z.argmax(-1) == teacher_logits[rows].argmax(-1)).sum()
    assert hits.item() == agree.item() >= 2


def test_draft_vocab_takes_the_most_frequent_ids_as_offsets():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7])
    vocab = from_counts(counts, 4)
    assert vocab.target_ids.tolist() == [0, 2, 3, 6]
    assert vocab.d2t.tolist() == [0, 1, 1, 3]  # target id = draft id + d2t[draft id]
    assert vocab.t2d.tolist() == [True, False, True, True, False, False, True]
    whole = from_counts(counts, 100)  # a small target vocabulary is taken whole
    assert whole.size == 7 and whole.d2t.tolist() == [0] * 7


@pytest.mark.parametrize("scale", [1e-16, 1e-30])
def test_the_fused_attentions_gradients_hold_for_tiny_upstream_gradients(scale):
    """Late in training (or under a small loss weight) the attention's upstream gradient can be
    tiny: folding the log-sum-exp's gradient in must not lose it where |dO|^2 falls under the
    smallest float32 numbers."""
    torch.manual_seed(5)
    q, context, others = _attention_inputs(2, T=40, Tc=40, grad=True)
    leaves = [q, *context, *[t for kv in others for t in kv]]
    g = torch.randn(2, 4, 40, 16) * scale
    got = torch.autograd.grad(ttt_attention(q, context, others, 0.25), leaves, g)
    want = torch.autograd.grad(dense_attention(q, context, others, 0.25), leaves, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a / scale, b / scale, atol=1e-5, rtol=1e-4)


def test_without_drafts_nothing_is_folded_into_the_attentions_backward(monkeypatch):
    """With no drafts the log-sum-exp is unused: its backward takes the kernel's own path, with
    no pass over zeros."""
    from eagle3d.drafter import model
    folds = []
    fold = model._fold_lse_grad
    monkeypatch.setattr(model, "_fold_lse_grad", lambda *a: folds.append(1) or fold(*a))
    q, context, _ = _attention_inputs(0, T=20, Tc=20, grad=True)
    ttt_attention(q, context, [], 0.25).sum().backward()
    assert folds == []
    q, context, others = _attention_inputs(1, T=20, Tc=20, grad=True)
    ttt_attention(q, context, others, 0.25).sum().backward()
    assert folds == [1]


def test_the_fused_attentions_gradients_hold_for_an_upstream_gradient_in_another_layout():
    """dO reaches the attention's backward laid out as its consumer made it (here a transposed
    view, as o_proj's input is); cuDNN's backward returns wrong gradients, without a word, for
    a layout other than its output's (_laid_out_like). On CPU PyTorch's kernel reads any layout:
    there this checks only that the gradients are right; on a GPU it fails without the fix."""
    torch.manual_seed(6)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    B, heads, kv_heads, T, D = 2, 4, 2, 128, 64  # a head size cuDNN's kernel takes
    leaves = [torch.randn(B, n, T, D, device=device, dtype=dtype, requires_grad=True)
              for n in (heads, kv_heads, kv_heads)]
    g = torch.randn(B, T, heads, D, device=device, dtype=dtype).transpose(1, 2)  # not contiguous
    got = torch.autograd.grad(ttt_attention(leaves[0], leaves[1:], [], 0.125), leaves, g)
    exact = [t.detach().float().requires_grad_() for t in leaves]
    want = torch.autograd.grad(dense_attention(exact[0], exact[1:], [], 0.125), exact, g.float())
    tol = dict(atol=3e-2, rtol=3e-2) if cuda else dict(atol=1e-5, rtol=1e-4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b, **tol)
