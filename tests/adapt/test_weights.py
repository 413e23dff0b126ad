"""Which operand is the weight, and the reads and einsums of models written in other styles: a weight stored
(out, in) and transposed before its dot (GPT-2's Conv1D), multi-query attention's broadcasting einsum, an NNX model
that reads its weights through the variable (QDoRA), a rule that matches nothing, `inspect`, and freezing."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from pallas_fused import adapt
from tests.adapt._models import flax_transformers
from tests.helpers import rel_err

D = 16


class Conv1D(nn.Module):
    """GPT-2's projection (as HF's Flax GPT-2 writes it): the kernel stored (out, in), transposed before the dot."""

    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.2), (self.features, x.shape[-1]))
        kernel = jnp.asarray(kernel.transpose(), self.dtype)
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return y + self.param("bias", nn.initializers.normal(0.1), (self.features,))


class Gpt2Block(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        q, k, v = jnp.split(Conv1D(3 * D, name="c_attn")(x), 3, axis=-1)      # non-square
        att = nn.Dropout(0.1, deterministic=deterministic)(jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / 4.0))
        x = x + Conv1D(D, name="c_proj")(jnp.einsum("bts,bsd->btd", att, v))   # square
        return x + Conv1D(D, name="mlp_proj")(jax.nn.gelu(Conv1D(4 * D, name="c_fc")(x)))


GPT2_RULES = [adapt.DoraRule(module_path="c_attn|c_proj", rank=4, alpha=8.0),
              adapt.LoraRule(module_path="c_fc|mlp_proj", rank=4)]


def _randomized(variables, seed=0):
    """Every adapter leaf moved to random values (B = 0 and m = ||W|| would hide a wrong layout)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(variables)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, x), key in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        bump = any(s in name for s in ("lora_a", "lora_b", "magnitude"))
        out.append(x + 0.3 * jax.random.normal(key, x.shape, x.dtype) if bump else x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _changed_leaves(a, b) -> set[str]:
    flat_a = {"/".join(str(k.key) for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(a)}
    flat_b = {"/".join(str(k.key) for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(b)}
    assert set(flat_a) == set(flat_b)
    return {p for p in flat_a if not np.array_equal(np.asarray(flat_a[p]), np.asarray(flat_b[p]))}


def _check_linen_round_trip(model, rules, pretrained, inputs, expect_adapted):
    """init equals the original; with random adapters, merge then the original model reproduces the adapted
    output; the merged params differ from the pretrained ones at the leaves inspect lists as adapted, only."""
    lmodel = adapt.apply(model, rules)
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(1), *inputs), pretrained)
    want = model.apply({"params": pretrained}, *inputs)
    got = lmodel.apply(variables, *inputs)
    want, got = (getattr(want, "logits", want), getattr(got, "logits", got))
    assert rel_err(got, want) <= 1e-6
    bumped = _randomized(variables)
    adapted_out = lmodel.apply(bumped, *inputs)
    merged = adapt.merge(lmodel, bumped)
    merged_out = model.apply(merged, *inputs)
    adapted_out, merged_out = (getattr(adapted_out, "logits", adapted_out), getattr(merged_out, "logits", merged_out))
    assert rel_err(adapted_out, want) > 1e-2  # the random adapters do change the output
    assert rel_err(merged_out, adapted_out) <= 1e-5
    report = adapt.inspect(model, rules, *inputs)
    assert set(report.adapted) == set(expect_adapted), str(report)
    assert _changed_leaves(merged["params"], pretrained) == set(report.adapted)
    return report


def test_transposed_weights_gpt2_conv1d():
    """A weight stored (out, in) and transposed before its dot is adapted in the operand's layout and merged back
    in its stored one: the square c_proj (once matched by shape in the stored layout) and the non-square c_attn /
    c_fc (once skipped)."""
    x = jax.random.normal(jax.random.key(0), (2, 5, D))
    model = Gpt2Block()
    pretrained = model.init(jax.random.key(2), x)["params"]
    report = _check_linen_round_trip(model, GPT2_RULES, pretrained, (x,),
                                     ["c_attn/kernel", "c_proj/kernel", "c_fc/kernel", "mlp_proj/kernel"])
    c_attn = next(c for c in report if c.weight_path == "c_attn/kernel")
    assert (c_attn.stored_shape, c_attn.k, c_attn.n) == ((3 * D, D), D, 3 * D)
    assert isinstance(c_attn.rule, adapt.DoraRule) and "transpose" in c_attn.reason


class ScaledCopy(nn.Module):
    """The operand has the kernel's shape but is not the kernel (a scaled copy of it)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.initializers.normal(0.2), (D, D))
        return jax.lax.dot_general(x, w * 2.0, (((1,), (0,)), ((), ())))


def test_a_shape_coincidence_is_not_the_weight():
    x = jax.random.normal(jax.random.key(0), (3, D))
    rule = adapt.LoraRule(module_path=".*", rank=2)
    lmodel = adapt.apply(ScaledCopy(), [rule])
    with pytest.warns(UserWarning, match=r"read by no contraction as they are, and are not adapted:\n  kernel "
                                         r"\(LoraRule\('\.\*'\)\)"):
        variables = lmodel.init(jax.random.key(0), x)
    assert set(variables["params"]) == {"kernel"}
    report = adapt.inspect(ScaledCopy(), [rule], x)
    assert report.adapted == ()
    refused = [c for c in report if c.action == "refused"]
    assert [c.weight_path for c in refused] == ["kernel"]
    assert "no contraction of the root module reads it" in refused[0].reason
    with pytest.warns(UserWarning, match="no rule matched any of the 1 contractions"):
        assert adapt.unused_rules(lmodel) == [rule]


class MqaAttention(nn.Module):
    """Multi-query attention: 4 query heads, 1 key-value head, the head axis broadcast by einsum; and einsums that
    are not plain contractions (a repeated index, one operand)."""

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        q = nn.Dense(4 * 4, name="q_proj")(x).reshape(b, t, 4, 4)
        k = nn.Dense(4, name="k_proj")(x).reshape(b, t, 1, 4)
        v = nn.Dense(4, name="v_proj")(x).reshape(b, t, 1, 4)
        att = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=-1)
        y = jnp.einsum("bnts,bsnh->btnh", att, v).reshape(b, t, 16)
        diag = jnp.einsum("btt->bt", jnp.einsum("btd,bsd->bts", x, x))
        return nn.Dense(D, name="o_proj")(y) + diag[..., None]


def test_mqa_broadcasting_einsum_runs_unchanged():
    x = jax.random.normal(jax.random.key(0), (2, 5, D))
    model = MqaAttention()
    pretrained = model.init(jax.random.key(1), x)["params"]
    rules = [adapt.LoraRule(module_path="(q|k|v|o)_proj", rank=2)]
    report = _check_linen_round_trip(model, rules, pretrained, (x,),
                                     [f"{p}_proj/kernel" for p in "qkvo"])
    assert any(c.action == "untouched" and "axes that broadcast (sizes n: 4 vs 1)" in c.reason for c in report)


class BroadcastWeight(nnx.Module):
    """A param in an einsum whose head axis broadcasts (4 against 1): not one plain contraction."""

    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (1, D, D)))

    def __call__(self, x):
        return jnp.einsum("bnd,ndf->bnf", x, self.w[...])


def test_a_rule_on_a_broadcasting_einsum_is_refused_by_path():
    x = jax.random.normal(jax.random.key(0), (2, 4, D))
    model = BroadcastWeight(nnx.Rngs(0))
    want = model(x)
    untargeted = adapt.apply(model, [adapt.LoraRule(module_path="nothing", rank=2)], x, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(untargeted(x)), np.asarray(want))
    with pytest.raises(ValueError, match=r"adapt: w: LoraRule.*matches, but einsum 'bnd,ndf->bnf' is not one "
                                         r"contraction of an activation with a weight \(axes that broadcast"):
        adapt.apply(model, [adapt.LoraRule(module_path="w", rank=2)], x, rngs=nnx.Rngs(0))
    report = adapt.inspect(model, [adapt.LoraRule(module_path="w", rank=2)], x)
    assert [c.action for c in report] == ["refused"]


class NnxReads(nnx.Module):
    """An NNX model reading its weights the ways model libraries do: through the variable, then .T, .astype,
    .reshape, jnp.asarray."""

    def __init__(self, rngs):
        def init(*shape):
            return jax.random.normal(rngs.params(), shape) / shape[-1] ** 0.5

        self.w_t = nnx.Param(init(2 * D, D))        # stored (out, in), read .T
        self.w_cast = nnx.Param(init(2 * D, D))     # read get_value().astype(...)
        self.w_heads = nnx.Param(init(D, 4 * 8))    # stored (d, heads * head_dim), read .reshape(d, heads, head_dim)
        self.w_asarray = nnx.Param(init(4, 8, D))   # read jnp.asarray(...)

    def __call__(self, x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # flax 0.12 deprecates .value; libraries use it
            h = jnp.einsum("btd,df->btf", x, self.w_t.value.T)
        h = jnp.einsum("btf,fd->btd", h, self.w_cast.get_value().astype(x.dtype))
        heads = jnp.einsum("btd,dhk->bthk", h, self.w_heads.get_value().reshape(D, 4, 8))
        return jnp.einsum("bthk,hkd->btd", heads, jnp.asarray(self.w_asarray.get_value(), jnp.float32))


def test_qdora_nnx_reads_through_the_variable():
    x = jax.random.normal(jax.random.key(0), (2, 3, D))
    model = NnxReads(nnx.Rngs(0))
    want = model(x)
    rules = [adapt.DoraRule(module_path=".*", rank=4, quantize="int8")]
    nmodel = adapt.apply(model, rules, x, rngs=nnx.Rngs(1))
    assert isinstance(nmodel.w_t.get_value(), adapt.QuantizedWeight)
    assert nmodel.w_t.get_value().shape == (2 * D, D) and nmodel.w_heads.get_value().ndim == 2
    assert nmodel.w_t.get_value().dtype == jnp.float32
    assert rel_err(nmodel(x), want) < 2e-2   # int8's rounding of W
    for name in ("w_t", "w_cast", "w_heads", "w_asarray"):
        for k in ("lora_a", "lora_b", "magnitude"):
            v = getattr(nmodel, f"{name}_{k}")
            v.set_value(v.get_value() + 0.3 * jax.random.normal(jax.random.key(len(name + k)), v.get_value().shape))
    adapted = nnx.jit(lambda m, x: m(x))(nmodel, x)
    assert rel_err(adapted, want) > 5e-2
    assert rel_err(adapt.merge(nmodel)(x), adapted) <= 1e-5
    assert set(adapt.inspect(model, rules, x).adapted) == {"w_t", "w_cast", "w_heads", "w_asarray"}


class BadRead(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)))

    def __call__(self, x):
        return jnp.einsum("bd,df->bf", x, self.w[...]) * self.w.get_value().mean()


def test_qdora_unsupported_read_names_path_and_read():
    x = jax.random.normal(jax.random.key(0), (2, D))
    with pytest.raises(ValueError, match=r"the QDoRA weight w was read as `.mean`"):
        adapt.apply(BadRead(nnx.Rngs(0)), [adapt.DoraRule(module_path="w", rank=2, quantize="nf4")], x,
                    rngs=nnx.Rngs(0))


def test_a_typo_is_reported_as_a_typo():
    x = jax.random.normal(jax.random.key(0), (2, 5, D))
    model = Gpt2Block()
    pretrained = model.init(jax.random.key(2), x)["params"]
    typo = adapt.LoraRule(module_path="c_atn", rank=2)
    lmodel = adapt.apply(model, [typo])
    variables = lmodel.init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=r"no rule matched any of the 6 contractions(.|\n)*'c_atn': nearest paths "
                                         r"\['c_attn'"):
        assert adapt.unused_rules(lmodel) == [typo]
    for call in (lambda: adapt.from_pretrained(lmodel, variables, pretrained),
                 lambda: adapt.merge(lmodel, variables)):
        with pytest.raises(ValueError, match="no rule matched any of the 6 contractions"):
            call()

    nmodel = adapt.apply(NnxReads(nnx.Rngs(0)), [adapt.LoraRule(module_path="w_hedas", rank=2)], x,
                         rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match=r"no rule matched any of the 4 contractions(.|\n)*\['w_heads'"):
        assert len(adapt.unused_rules(nmodel)) == 1
    with pytest.raises(ValueError, match="no rule matched any of the 4 contractions"):
        adapt.merge(nmodel)


def test_inspect_leaves_models_untouched_and_prints_a_table():
    x = jax.random.normal(jax.random.key(0), (2, 5, D))
    model = Gpt2Block()
    rules = [adapt.DoraRule(module_path="c_attn", rank=4), adapt.Fp8Rule(module_path="c_fc"),
             adapt.LoraRule(module_path="c_proj", rank=64)]
    report = adapt.inspect(model, rules, x, deterministic=True)  # a flag stays a Python value
    assert isinstance(report, adapt.Inspection) and all(isinstance(c, adapt.Contraction) for c in report)
    by_path = {c.weight_path: c for c in report}
    assert by_path["c_attn/kernel"] == adapt.Contraction("c_attn", "kernel", (3 * D, D), D, 3 * D, rules[0],
                                                         "adapted", "read as w.transpose(1, 0)")
    assert by_path["c_fc/kernel"].action == "adapted" and by_path["c_fc/kernel"].rule is rules[1]
    assert by_path["c_proj/kernel"].action == "refused" and "rank 64 is larger" in by_path["c_proj/kernel"].reason
    assert by_path["mlp_proj/kernel"].action == "untouched" and by_path["mlp_proj/kernel"].rule is None
    assert sum(c.weight is None for c in report) == 2  # q k and attention x v
    table = str(report)
    assert table.splitlines()[0].split() == ["path", "stored", "K", "x", "N", "rule", "action", "reason"]
    assert "c_attn/kernel" in table and "16 x 48" in table and "DoraRule('c_attn')" in table
    assert report.adapted == ("c_attn/kernel", "c_fc/kernel")
    assert type(model) is Gpt2Block

    nmodel = NnxReads(nnx.Rngs(0))
    before = nnx.state(nmodel)
    report = adapt.inspect(nmodel, [adapt.LoraRule(module_path="w_(t|heads)", rank=2)], x)
    assert report.adapted == ("w_t", "w_heads")
    assert type(nmodel) is NnxReads and not hasattr(nmodel, "w_t_lora_a")
    assert jax.tree.all(jax.tree.map(lambda a, b: a is b, before, nnx.state(nmodel)))


class Small(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(D, name="out")(jax.nn.gelu(nn.Dense(2 * D, name="up")(x)))


def test_optimizer_keeps_frozen_weights_bit_identical():
    """adapt.optimizer trains the adapters and zeroes every other update; optax.masked alone would not."""
    x = jax.random.normal(jax.random.key(0), (4, D))
    lmodel = adapt.apply(Small(), [adapt.DoraRule(module_path="up|out", rank=2)])
    params = lmodel.init(jax.random.key(1), x)["params"]
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.1 if "lora_b" in jax.tree_util.keystr(p) else v, params)

    def loss(p):
        return jnp.mean((lmodel.apply({"params": p}, x) - 1.0) ** 2)

    def train(tx, params):
        state = tx.init(params)
        for _ in range(3):
            updates, state = tx.update(jax.grad(loss)(params), state, params)
            params = optax.apply_updates(params, updates)
        return params

    trained = train(adapt.optimizer(optax.adam(1e-2), {"params": params}), params)
    changed = _changed_leaves(trained, params)
    assert changed == {f"{m}/kernel_{k}" for m in ("up", "out") for k in ("lora_a", "lora_b", "magnitude")}
    masked = train(optax.masked(optax.adam(1e-2), adapt.trainable(params)), params)
    assert "norm/scale" in _changed_leaves(masked, params)  # the pitfall the docs warn about


@pytest.mark.slow  # an HF model: the floor leg only
def test_hf_flax_gpt2():
    """HF transformers' Flax GPT-2 (c_attn, c_proj, c_fc stored (out, in), transposed before the dot)."""
    transformers = flax_transformers()
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    hf = transformers.FlaxGPT2LMHeadModel(cfg, seed=0)
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    inputs = (ids, jnp.ones((2, 8), jnp.int32), jnp.broadcast_to(jnp.arange(8), (2, 8)))
    rules = [adapt.DoraRule(module_path=r".*/attn/(c_attn|c_proj)", rank=4, alpha=8.0),
             adapt.LoraRule(module_path=r".*/mlp/(c_fc|c_proj)", rank=4)]
    expect = [f"transformer/h/{i}/{m}/kernel" for i in range(2)
              for m in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")]
    _check_linen_round_trip(hf.module, rules, hf.params, inputs, expect)
