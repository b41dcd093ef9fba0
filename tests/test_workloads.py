import math

import pytest
import torch

from distsync.errors import ConfigError
from distsync.workloads import ShardSampler, load_workload


@pytest.mark.parametrize("name, n_train, n_eval, shape", [
    ("digits", 1437, 360, (64,)),
    ("mnist", 4000, 1000, (1, 28, 28)),
    ("cnn", 4096, 512, (3, 32, 32)),
])
def test_shipped_workloads_shapes_and_untrained_accuracy(name, n_train, n_eval, shape):
    w = load_workload(name)
    assert w.num_train == n_train and len(w.eval_data[0]) == n_eval
    assert tuple(w.train_data[0].shape[1:]) == shape
    assert set(w.train_data[1].unique().tolist()) == set(range(10))
    torch.manual_seed(0)
    m = w.make_model()
    assert m(w.train_data[0][:4]).shape == (4, 10)
    # an untrained model is near chance, far from the target
    assert w.evaluate(m, torch.device("cpu"))["metric"] < 0.4 < w.target


def test_sampler_shards_are_disjoint_cover_and_deterministic():
    samplers = [ShardSampler(103, 4, r, 5, seed=7) for r in range(4)]
    shards = [set(s.shard_items.tolist()) for s in samplers]
    assert sum(len(s) for s in shards) == 103 and set().union(*shards) == set(range(103))
    for r, s in enumerate(samplers):
        epoch0 = torch.cat([s.indices(i) for i in range(s.steps_per_epoch)])
        assert len(set(epoch0.tolist())) == len(epoch0)  # no repeats inside an epoch
        assert set(epoch0.tolist()) <= shards[r]
        again = ShardSampler(103, 4, r, 5, seed=7)
        assert torch.equal(again.indices(3), s.indices(3))
        # the next epoch is reshuffled
        assert not torch.equal(s.indices(0), s.indices(s.steps_per_epoch))
    assert not torch.equal(ShardSampler(103, 4, 0, 5, seed=8).shard_items, samplers[0].shard_items)


def test_sampler_refuses_shards_smaller_than_a_batch():
    with pytest.raises(ValueError, match="fewer than the batch size 64"):
        ShardSampler(100, 4, 0, 64, seed=0)


def test_user_workload_by_path():
    w = load_workload("tests/fixtures/tiny_workload.py:make_workload")
    assert w.name == "tiny" and w.num_train == 500
    with pytest.raises(ConfigError, match="does not define nope"):
        load_workload("tests/fixtures/tiny_workload.py:nope")


def test_digits_is_sklearns_data_and_split_without_importing_sklearn():
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_ev, y_tr, y_ev = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    std[std == 0] = 1.0
    w = load_workload("digits")
    assert torch.equal(w.train_data[1], torch.tensor(y_tr)) and torch.equal(w.eval_data[1], torch.tensor(y_ev))
    np.testing.assert_allclose(w.train_data[0].numpy(), (x_tr - mean) / std, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w.eval_data[0].numpy(), (x_ev - mean) / std, rtol=1e-6, atol=1e-6)
    # a process that builds the workload does not pay for sklearn (a second at start-up)
    code = ("import sys; from distsync.workloads import load_workload; load_workload('digits'); "
            "print(sorted(m for m in ('sklearn', 'scipy', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_lm_is_next_byte_prediction_on_pythons_own_source():
    from distsync.workloads.lm import VOCAB, python_text

    w = load_workload("lm")
    x, y = w.train_data
    assert x.shape[1] == 64 and x.dtype == torch.long and int(x.max()) < VOCAB
    text = python_text()
    assert bytes(x[0].tolist()) == text[:64] and bytes(y[0].tolist()) == text[1:65]  # one byte on
    assert len(w.eval_data[0]) == (len(text) - len(text) * 9 // 10 - 1) // 64  # the last tenth
    torch.manual_seed(0)
    model = w.make_model().requires_grad_(False)
    out = model(x[:4])
    assert out.shape == (4, 64, VOCAB)
    # untrained: about uniform over 256 bytes; causal: a position does not see the ones after it
    assert abs(float(w.loss_fn(out, y[:4])) - math.log(VOCAB)) < 0.5
    changed = x[:1].clone()
    changed[0, 40:] = (changed[0, 40:] + 1) % VOCAB
    torch.testing.assert_close(model(changed)[0, :40], out[0, :40])
