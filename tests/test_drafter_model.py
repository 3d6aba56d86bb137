"""The drafter's shapes, its training-time test against chain drafting, and the draft vocab."""

import torch

from eagle3d.drafter.model import DraftConfig, Eagle3Drafter
from eagle3d.drafter.vocab import from_counts

TINY = DraftConfig(hidden_size=32, target_hidden_size=24, intermediate_size=64,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                   max_position_embeddings=256, vocab_size=50, draft_vocab_size=20,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def tiny_model() -> Eagle3Drafter:
    torch.manual_seed(0)
    return Eagle3Drafter(TINY, torch.randn(50, 32)).eval()


def test_shapes_and_loss_counts_only_masked_positions():
    model = tiny_model()
    ids, aux = torch.randint(0, 50, (2, 12)), torch.randn(2, 12, 72)
    outs = model.unroll(ids, aux, 3)
    assert [tuple(o.shape) for o in outs] == [(2, 12, 32)] * 3
    assert tuple(model.logits(outs[0]).shape) == (2, 12, 20)
    teacher = torch.softmax(torch.randn(2, 12, 20), -1)
    targets = torch.zeros(2, 12, dtype=torch.bool)
    targets[0, 5] = True  # one counted teacher: index 5 is learnt by step 0 at 4, step 2 at 2
    loss, per_step, correct, counted = model(ids, aux, teacher, targets, 3)
    assert counted.tolist() == [1, 1, 1]
    targets[1, 0] = True  # index 0 has no earlier index to learn it from
    assert model(ids, aux, teacher, targets, 3)[3].tolist() == [1, 1, 1]
    loss.backward()
    assert model.fc.weight.grad is not None and model.embed_tokens.grad is None
    assert "embed_tokens" not in model.state_dict()


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


def test_draft_vocab_takes_the_most_frequent_ids_as_offsets():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7])
    vocab = from_counts(counts, 4)
    assert vocab.target_ids.tolist() == [0, 2, 3, 6]
    assert vocab.d2t.tolist() == [0, 1, 1, 3]  # target id = draft id + d2t[draft id]
    assert vocab.t2d.tolist() == [True, False, True, True, False, False, True]
    whole = from_counts(counts, 100)  # a small target vocabulary is taken whole
    assert whole.size == 7 and whole.d2t.tolist() == [0] * 7
