"""The MLX model file restates what an IHA layer is (mlx-lm loads it as one file, so it cannot import the travelling
folder): these tests hold it equal to the folder's owner of that meaning, `iha/models/iha/layer_iha.py` and
`mixing_iha.py`.

Read from the file's source (no mlx needed): the IHA fields it declares and reads are `layer_iha`'s fields under the
same names and types, with no default of their own (`iha export mlx` writes every one into config.json, so a default
here could only disagree with `FIELD_DEFAULTS`); every IHA field it leaves out is one inference does not read; the
choices it compares a field with are that field's `FIELD_CHOICES`; its `virtual_window` is
`IHALayerSpec.virtual_window` for every attention type, P and window. With mlx installed: each layer it builds from an
`IHAConfig` is that config's `layer_spec`, its mixing and collapse matrices are `mixing_iha`'s on random tensors (and its
head mixing and collapse compute the products those matrices define), and its `virtual_mask` is
`naive_iha.reference_mask` (prefill and decode, windows, left padding). End to end against transformers:
tests/models/mlx/test_mlx_model.py.
"""

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from iha import IHAConfig
from iha.export.mlx import MLX_MODEL_SOURCE
from iha.models.iha import layer_iha, mixing_iha
from iha.models.iha.layer_iha import ATTENTION_TYPES, FIELD_CHOICES, FIELD_DEFAULTS, IHALayerSpec, is_iha_layer
from iha.models.iha.naive_iha import reference_mask


MLX_TREE = ast.parse(MLX_MODEL_SOURCE.read_text(encoding="utf-8"))
# The IHA fields that only conversion and training read: the folder's weights already hold what they decided.
NOT_READ_BY_INFERENCE = {"iha_collapse_init": "how conversion initializes the collapse; the weights hold the result"}


def class_fields(tree: ast.Module, class_name: str) -> dict[str, ast.AnnAssign]:
    """The annotated fields of a dataclass in `tree`, by name."""
    (class_node,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    return {
        node.target.id: node
        for node in class_node.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def attributes_read(tree: ast.Module) -> set[str]:
    """Every `x.name` the file reads (the model reads its config as `args.<field>`, ModelArgs as `self.<field>`)."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def looks_like_an_iha_field(name: str) -> bool:
    return name in FIELD_DEFAULTS or name.startswith("iha_") or "pseudo" in name


MLX_FIELDS = class_fields(MLX_TREE, "ModelArgs")
LAYER_FIELDS = class_fields(ast.parse(Path(layer_iha.__file__).read_text(encoding="utf-8")), "IHAAttentionFields")


def test_the_iha_fields_it_declares_and_reads_are_layer_ihas_under_the_same_names():
    assert set(LAYER_FIELDS) == set(FIELD_DEFAULTS)  # the source read here is the class FIELD_DEFAULTS comes from
    read_from_config = {name for name in attributes_read(MLX_TREE) if name in MLX_FIELDS}
    iha_like = {name for name in {*MLX_FIELDS, *read_from_config} if looks_like_an_iha_field(name)}
    assert iha_like <= set(FIELD_DEFAULTS), (
        f"not IHA fields (layer_iha.FIELD_DEFAULTS): {iha_like - set(FIELD_DEFAULTS)}"
    )
    # Every IHA field the file declares is read, and every one it leaves out is one inference does not need.
    declared = set(FIELD_DEFAULTS) & set(MLX_FIELDS)
    assert declared <= read_from_config
    assert set(FIELD_DEFAULTS) - declared == set(NOT_READ_BY_INFERENCE)


@pytest.mark.parametrize("name", sorted(set(FIELD_DEFAULTS) - set(NOT_READ_BY_INFERENCE)))
def test_an_iha_field_carries_no_default_and_layer_ihas_type(name):
    field = MLX_FIELDS[name]
    assert field.value is None, (
        f"ModelArgs.{name} has a default ({ast.unparse(field.value)}): the IHA fields' defaults are written once, in "
        "layer_iha.IHAAttentionFields; `iha export mlx` writes every field into config.json"
    )
    # Required here, so never None: layer_iha's type without the `| None` that its filled-in-later fields carry.
    expected = ast.unparse(LAYER_FIELDS[name].annotation).removesuffix(" | None")
    assert ast.unparse(field.annotation) == expected


def compared_strings(tree: ast.Module, field: str) -> set[str]:
    """The string constants the file compares `field` (as `x.field`, or a local named without the `iha_` prefix, as
    `mask_mode`) with: `==`, `!=`, `in` and `not in` a tuple."""
    spellings = {field, field.removeprefix("iha_")}

    def names(node) -> set[str]:
        if isinstance(node, ast.Attribute):
            return {node.attr}
        return {node.id} if isinstance(node, ast.Name) else set()

    def constants(node) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {element.value for element in node.elts if isinstance(element, ast.Constant)}
        return set()

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(names(operand) & spellings for operand in operands):
                found |= set().union(*(constants(operand) for operand in operands))
    return found


@pytest.mark.parametrize("field", sorted(set(FIELD_CHOICES) - set(NOT_READ_BY_INFERENCE)))
def test_the_choices_it_compares_a_field_with_are_layer_ihas(field):
    compared = compared_strings(MLX_TREE, field)
    assert compared, f"the MLX file never compares {field} with its choices"
    assert compared <= set(FIELD_CHOICES[field])


def mlx_function(name: str):
    """A function of the MLX file that uses no mlx, run from its source (this test needs no mlx for it)."""
    (node,) = [node for node in MLX_TREE.body if isinstance(node, ast.FunctionDef) and node.name == name]
    namespace = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(MLX_MODEL_SOURCE), "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_virtual_window_is_the_layer_specs(attention_type):
    virtual_window = mlx_function("virtual_window")
    for num_pseudo_heads, sliding_window in itertools.product((1, 2, 3, 4), (None, 2, 3, 7)):
        if sliding_window is None and attention_type.endswith("sliding_attention"):
            continue  # the config refuses sliding layers without a window
        # What `IHAAttentionFields.layer_spec` gives that layer: P on IHA layers, 1 on standard ones.
        layer_pseudo_heads = num_pseudo_heads if is_iha_layer(attention_type) else 1
        spec = IHALayerSpec(attention_type, layer_pseudo_heads, sliding_window)
        assert virtual_window(attention_type, sliding_window, layer_pseudo_heads) == spec.virtual_window, (
            attention_type,
            num_pseudo_heads,
            sliding_window,
        )


# --- with mlx --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_file():
    pytest.importorskip("mlx_lm")
    from iha.models.mlx import modeling_iha_mlx

    return modeling_iha_mlx


def as_mlx(array: np.ndarray):
    import mlx.core as mx

    return mx.array(array)


def as_torch(array) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


@pytest.mark.parametrize("mask_mode", layer_iha.MASK_MODES)
@pytest.mark.parametrize("position_mode", layer_iha.POSITION_MODES)
@pytest.mark.parametrize("cache_mode", layer_iha.CACHE_MODES)
def test_each_layer_it_builds_is_the_configs_layer_spec(mlx_file, mask_mode, position_mode, cache_mode):
    config = IHAConfig(
        vocab_size=32,
        hidden_size=24,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_pseudo_heads=3,
        attention_types=list(ATTENTION_TYPES),
        sliding_window=5,
        iha_mask_mode=mask_mode,
        iha_position_mode=position_mode,
        iha_cache_mode=cache_mode,
    )
    args = mlx_file.ModelArgs.from_dict(config.to_dict())
    for layer_idx in range(config.num_hidden_layers):
        attention = mlx_file.Attention(args, layer_idx, rope=None)
        spec = config.layer_spec(layer_idx)
        assert attention.is_iha == spec.is_iha
        assert attention.num_pseudo == spec.num_pseudo_heads
        assert attention.virtual_window == spec.virtual_window
        if spec.is_iha:  # a standard layer (P = 1) runs plain causal attention whatever the IHA modes say
            assert attention.mask_mode == spec.mask_mode
            # Virtual positions: the pseudo-tokens of one token sit at positions of their own.
            assert attention.virtual_positions == (spec.virtual_position(1, 0) != spec.virtual_position(1, 1))
            assert attention.caches_tokens == (spec.cache_mode == "token")
        assert hasattr(attention, "head_mixing") == spec.is_iha


@pytest.mark.parametrize("num_sources, num_targets, num_pseudo", [(4, 4, 2), (2, 2, 3), (3, 3, 1), (4, 4, 4)])
def test_mixing_and_collapse_matrices_are_mixing_ihas(mlx_file, num_sources, num_targets, num_pseudo):
    generator = np.random.default_rng(num_sources * 10 + num_pseudo)
    alpha = generator.standard_normal((num_sources, num_targets, num_pseudo), dtype=np.float32)
    expected = mixing_iha.mixing_matrix(torch.from_numpy(alpha))
    assert torch.equal(as_torch(mlx_file.mixing_matrix(as_mlx(alpha))), expected)

    collapse = generator.standard_normal((num_targets, num_targets, num_pseudo), dtype=np.float32)
    expected = mixing_iha.collapse_matrix(torch.from_numpy(collapse))
    assert torch.equal(as_torch(mlx_file.collapse_matrix(as_mlx(collapse))), expected)


@pytest.mark.parametrize("collapse_mode", layer_iha.COLLAPSE_MODES)
def test_head_mixing_and_collapse_compute_mixing_ihas_products(mlx_file, collapse_mode):
    """`HeadMixing.mix` puts pseudo-head (h, p) of token n at virtual row n * P + p, the product of mixing_iha's matrix;
    `collapse_heads` is mixing_iha's collapse matrix (per head: its diagonal form) times the P * H pseudo-outputs."""
    batch_size, num_tokens, num_heads, num_kv_heads, num_pseudo, head_dim = 2, 5, 4, 2, 3, 8
    generator = np.random.default_rng(7)
    mixing = mlx_file.HeadMixing(num_heads, num_kv_heads, num_pseudo, collapse_mode)
    alpha = generator.standard_normal((num_kv_heads, num_kv_heads, num_pseudo), dtype=np.float32)
    states = generator.standard_normal((batch_size, num_tokens, num_kv_heads, head_dim), dtype=np.float32)
    mixed = as_torch(mixing.mix(as_mlx(states), as_mlx(alpha)))  # [B, H, N * P, d]
    product = mixing_iha.mixing_matrix(torch.from_numpy(alpha)) @ torch.from_numpy(states)  # [B, N, P * H, d]
    expected = product.reshape(batch_size, num_tokens * num_pseudo, num_kv_heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(mixed, expected, rtol=1e-6, atol=1e-6)

    collapse_shape = (num_heads, num_pseudo) if collapse_mode == "per_head" else (num_heads, num_heads, num_pseudo)
    collapse = generator.standard_normal(collapse_shape, dtype=np.float32)
    mixing.collapse = as_mlx(collapse)
    output = generator.standard_normal((batch_size, num_heads, num_tokens * num_pseudo, head_dim), dtype=np.float32)
    collapsed = as_torch(mixing.collapse_heads(as_mlx(output)))  # [B, N, H * d]
    pseudo = torch.from_numpy(output).transpose(1, 2).reshape(batch_size, num_tokens, num_pseudo * num_heads, head_dim)
    expected = (mixing_iha.collapse_matrix(torch.from_numpy(collapse)) @ pseudo).flatten(2)
    torch.testing.assert_close(collapsed, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_pseudo", [1, 2, 3])
@pytest.mark.parametrize("mask_mode", layer_iha.MASK_MODES)
@pytest.mark.parametrize("sliding_window", [None, 2, 3])
def test_virtual_mask_is_the_reference_mask(mlx_file, num_pseudo, mask_mode, sliding_window):
    """The rows of the new tokens (all of them, or the last few as in decoding) of `naive_iha.reference_mask`, with
    left padding or without, the window given as the layer spec's `virtual_window`."""
    num_tokens = 7
    attention_type = layer_iha.IHA_SLIDING if sliding_window else layer_iha.IHA_FULL
    virtual_window = IHALayerSpec(attention_type, num_pseudo, sliding_window).virtual_window
    for num_new, left_padding in itertools.product((num_tokens, 3, 1), (None, [0, 3])):
        padding_mask = None
        if left_padding is not None:
            padding_mask = torch.arange(num_tokens)[None] >= torch.tensor(left_padding)[:, None]
        expected = reference_mask(num_tokens, num_pseudo, mask_mode, sliding_window, padding_mask)
        expected = expected[:, (num_tokens - num_new) * num_pseudo :]
        padding = None if left_padding is None else as_mlx(np.array(left_padding))
        mask = mlx_file.virtual_mask(num_new, num_tokens, num_pseudo, mask_mode, virtual_window, padding)
        assert torch.equal(as_torch(mask)[:, 0], expected), (num_new, left_padding)
