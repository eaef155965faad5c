"""The golden streamed from its float32 weights (impl_numpy.cast.CastOnRead): the same functions on a
mapping that casts each tensor as it is read and holds at most a budget of them, so a model whose
float64 copy does not fit runs layer by layer. It must give the whole-model golden's bits on
every case, hold no more than its budget (plus the one tensor being read), and really stream:
with a layer's budget, a whole-model case reads some tensors more than once."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends.numpy_backend import GradientReference, NumpyRunner, golden_output
from conformance.cases import build_case, case_names
from conformance.plan.memory import GOLDEN_SHARE, golden_budget
from impl_numpy.cast import CastOnRead, layer_bytes
from spec import conformance_params, get_preset, params_under
from tests.variants import PROPERTY_CONFIGS

# learned-pos's options (learned positions, shared embeddings) at a tiny size: a property of options
# (tests/variants.PROPERTY_CONFIGS), where learned-pos's 11M parameters took 44 s of CI's suite
PRESETS = ["tiny", "tiny.learned_swish_shared_embednorm", "char-lm", "llama-tiny", "qwen3-tiny", "stablelm-tiny"]


def _same(a, b, where: str) -> None:
    if isinstance(a, GradientReference):
        a, b = a.gradients, b.gradients
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for name in a:
            _same(a[name], b[name], f"{where}: {name}")
    elif isinstance(a, tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b), where


@pytest.mark.parametrize("preset", PRESETS)
def test_streamed_golden_equals_the_whole_golden_bit_for_bit(preset):
    cfg = PROPERTY_CONFIGS[preset]
    params = conformance_params(cfg, seed=0)
    whole = NumpyRunner(cfg, params, "float64")
    budget = layer_bytes(cfg, params)
    streamed = NumpyRunner(cfg, params, "float64", budget=budget)
    largest = max(value.size for value in params.values()) * 8
    names = case_names(cfg, backward=True)
    gradient_cases = [name for name in names if name[0].startswith("grad-")][::4]  # a spread of them
    for sublayer, mask_case in [name for name in names if not name[0].startswith(("grad-", "train_"))] + gradient_cases:
        case = build_case(cfg, params, sublayer, mask_case)
        _same(golden_output(cfg, params, sublayer, case.inputs, whole),
              golden_output(cfg, params, sublayer, case.inputs, streamed), f"{preset} {case.name}")
    assert isinstance(streamed.p, CastOnRead) and isinstance(whole.p, dict)
    assert streamed.p.most_held <= budget + largest
    assert streamed.p.casts > 2 * len(params)  # it streamed: the whole-model cases read the layers again


def test_a_budget_of_none_casts_each_tensor_once_and_keeps_it():
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg, seed=0)
    p = CastOnRead(cfg, params)
    for _ in range(3):
        for name in params:
            assert p[name].dtype == np.float64 and np.array_equal(p[name], params[name])
    assert p.casts == len(params) and p.most_held == sum(value.size * 8 for value in params.values())


def test_the_views_under_a_module_read_nothing_until_used():
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg, seed=0)
    p = CastOnRead(cfg, params, budget=0)
    layer = params_under(p, "decoder.layers.1")
    ffn = params_under(layer, "ffn")
    assert p.casts == 0
    assert sorted(ffn) == sorted(name[len("decoder.layers.1.ffn."):] for name in params
                                 if name.startswith("decoder.layers.1.ffn."))
    assert "w1.weight" in ffn and "w9.weight" not in ffn and len(ffn) == len(list(ffn))
    assert np.array_equal(ffn["w1.weight"], params["decoder.layers.1.ffn.w1.weight"]) and p.casts == 1
    assert p.held_bytes == params["decoder.layers.1.ffn.w1.weight"].size * 8  # a budget of 0 keeps the last one read


def test_the_golden_streams_only_where_its_whole_cast_would_not_fit():
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg, seed=0)
    whole = sum(value.size for value in params.values()) * 8
    assert golden_budget(cfg, params, available=int(whole / GOLDEN_SHARE) + 1) is None
    streamed = golden_budget(cfg, params, available=int(whole / GOLDEN_SHARE) - 8)
    assert streamed is not None and layer_bytes(cfg, params) <= streamed < whole


def test_a_run_of_one_forward_case_streams_the_golden_and_drops_it_once_its_reference_is_made(monkeypatch):
    """The one-cell check (-k forward-none): a whole float64 cast would hold every layer to read
    each once; streamed, the golden holds about one layer, and once the run's every reference is
    made it holds none under the column (Qwen2.5-0.5B's shape: 8.4 GB to 5.4 GB)."""
    from conformance.executors.in_process import InProcess
    from conformance.harness import PASS, plan_matrix, run_matrix
    from conformance.plan.memory import golden_budget_for, reads_each_weight_once

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg, seed=0)
    forward, decode = (build_case(cfg, params, *name) for name in (("forward", "none"), ("decode", "incremental")))
    assert reads_each_weight_once([forward]) and reads_each_weight_once([forward, forward])
    assert not reads_each_weight_once([decode]) and not reads_each_weight_once([forward, decode])
    assert not reads_each_weight_once([build_case(cfg, params, "grad-loss", "none")])  # a backward pass reads again
    assert golden_budget_for(cfg, params, [forward]) == 2 * layer_bytes(cfg, params)
    assert golden_budget_for(cfg, params, [forward, decode]) is None  # a tiny model's whole cast fits
    goldens, run = [], InProcess.run

    def watched(self, cfg, params, work, on_result):
        goldens.append(self.golden)
        return run(self, cfg, params, work, on_result)

    monkeypatch.setattr(InProcess, "run", watched)
    plan = plan_matrix(cfg, ["numpy-float32"], ["float32"], ["cpu"])
    one, = run_matrix(cfg, params, plan, pattern="forward-none-*", jobs=1)
    assert one.status == PASS and goldens[-1].budget == 2 * layer_bytes(cfg, params)
    assert "p" not in vars(goldens[-1])  # released: its reference was the run's last
    cells = run_matrix(cfg, params, plan, pattern="forward-none-*|decode-incremental-*", jobs=1)
    assert [cell.status for cell in cells] == [PASS, PASS] and goldens[-1].budget is None


def test_a_kept_golden_makes_each_case_and_reference_once_across_runs(monkeypatch):
    """A gallery of mistakes runs the matrix once per mistake on the same model: with a kept golden
    (conformance.cells.KeptGolden) each case is built and its reference computed in the first run
    that needs it, and every later run gets the same verdicts from them; a kept golden of other
    weights, or of another config, is refused by name."""
    import conformance.cells as cells
    from conformance.cells import KeptGolden
    from conformance.harness import plan_matrix, run_matrix

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg, seed=0)
    computed, compute = [], cells.golden_output

    def counted(cfg, params, sublayer, inputs, runner=None):
        computed.append(sublayer)
        return compute(cfg, params, sublayer, inputs, runner)

    monkeypatch.setattr(cells, "golden_output", counted)
    plan, pattern = plan_matrix(cfg, ["numpy-float32"], ["float32"], ["cpu"]), "forward-*|decode-*|mha-*"
    alone = run_matrix(cfg, params, plan, pattern=pattern)
    made_alone = len(computed)
    kept = KeptGolden(cfg, params)
    first = run_matrix(cfg, params, plan, pattern=pattern, kept_golden=kept)
    # the same weights in another mapping (as a mutation's model is given them) are the same model
    second = run_matrix(cfg, dict(params), plan, pattern=pattern, kept_golden=kept)
    assert made_alone >= 5 and len(computed) == 2 * made_alone  # the second run made none
    assert [(r.test_id, r.status, r.max_abs_err) for r in alone] == [(r.test_id, r.status, r.max_abs_err)
                                                                     for r in first] == \
        [(r.test_id, r.status, r.max_abs_err) for r in second]
    assert len(kept.references) == made_alone and len(kept.cases) == made_alone
    name = next(iter(params))
    other = {**params, name: 0.5 * params[name]}
    with pytest.raises(ValueError, match="the golden of another model"):
        run_matrix(cfg, other, plan, pattern=pattern, kept_golden=kept)
    with pytest.raises(ValueError, match="the golden of another model"):
        run_matrix(cfg.replace(norm_eps=1e-3), params, plan, pattern=pattern, kept_golden=kept)
