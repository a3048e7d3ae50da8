"""Model presets and JSON specs: shapes, counts, Muon routing, loader errors."""

import json
import math
import pathlib

import pytest

from lwjax.layout import ParamSpec
from lwjax.routing import is_embedding_or_output
from lwjax.tools.presets import (
    PRESETS,
    preset_specs,
    specs_from_json,
    specs_to_json,
    transformer_specs,
)

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "layouts"


def _total(specs):
    return sum(spec.numel for spec in specs)


def _by_name(specs):
    return {spec.name: spec for spec in specs}


def test_llama8b_has_llama3_8b_shapes_and_count():
    specs = preset_specs("llama8b")
    assert len(specs) == 1 + 32 * 6 + 2
    assert _total(specs) == 8_030_261_248  # Llama-3-8B, untied
    by_name = _by_name(specs)
    assert by_name["embedding.word_embeddings.weight"].shape == (128256, 4096)
    assert by_name["output_layer.weight"].shape == (128256, 4096)
    assert by_name["decoder.layers.31.self_attention.linear_qkv.weight"].shape == (
        (32 + 2 * 8) * 128,
        4096,
    )
    assert by_name["decoder.layers.0.self_attention.linear_proj.weight"].shape == (4096, 4096)
    assert by_name["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 14336, 4096)
    assert by_name["decoder.layers.0.mlp.linear_fc2.weight"].shape == (4096, 14336)
    assert by_name["decoder.layers.0.input_layernorm.weight"].shape == (4096,)
    assert by_name["decoder.final_layernorm.weight"].shape == (4096,)


def test_llama1b_shapes_and_count():
    specs = preset_specs("llama1b")
    assert len(specs) == 1 + 16 * 6 + 2
    assert math.isclose(_total(specs), 1.4985e9, rel_tol=1e-3)
    by_name = _by_name(specs)
    assert by_name["decoder.layers.15.self_attention.linear_qkv.weight"].shape == (3072, 2048)
    assert by_name["decoder.layers.0.mlp.linear_fc1.weight"].shape == (16384, 2048)
    assert "output_layer.weight" in by_name


def test_moe_has_experts_and_a_dense_router():
    specs = preset_specs("moe")
    experts = [s for s in specs if s.is_expert]
    assert len(experts) == 32 * 8 * 2
    assert all(s.is_muon and s.name.startswith("decoder.layers.") for s in experts)
    assert math.isclose(_total(specs), 46.70e9, rel_tol=1e-3)  # Mixtral-8x7B
    by_name = _by_name(specs)
    fc1 = by_name["decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"]
    assert fc1.shape == (2 * 14336, 4096) and fc1.is_expert
    assert by_name["decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight"].shape == (
        4096,
        14336,
    )
    router = by_name["decoder.layers.3.mlp.router.weight"]
    assert router.shape == (8, 4096) and router.is_muon and not router.is_expert
    assert "decoder.layers.3.mlp.linear_fc1.weight" not in by_name


def test_tied_is_gpt2_small_with_an_embedding_laid_out_as_at_pipeline_size_1():
    specs = preset_specs("tied")
    assert _total(specs) == 124_439_808  # GPT-2 small
    assert not any(s.is_shared_embedding for s in specs)  # Megatron isolates it only at PP > 1
    embedding = specs[0]
    assert embedding.name == "embedding.word_embeddings.weight"
    assert embedding.shape == (50257, 768) and not embedding.is_muon
    assert not any(s.name.startswith("output_layer") for s in specs)
    assert _by_name(specs)["decoder.layers.0.mlp.linear_fc1.weight"].shape == (3072, 768)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_route_muon_by_megatron_rule(name):
    specs = preset_specs(name, layers=2)
    assert len({s.name for s in specs}) == len(specs)
    assert specs[0].name == "embedding.word_embeddings.weight"
    assert all(s.dtype == "bfloat16" for s in specs)
    for spec in specs:
        # Megatron's rule, checked against lwjax.routing on the /-joined path.
        expected = len(spec.shape) == 2 and not is_embedding_or_output(spec.name.replace(".", "/"))
        assert spec.is_muon == expected, spec.name


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_specs_layers_override(name):
    one, two, three = (preset_specs(name, layers=n) for n in (1, 2, 3))
    per_layer = len(two) - len(one)
    assert per_layer > 0 and len(three) - len(two) == per_layer
    assert not any(s.name.startswith("decoder.layers.1.") for s in one)
    assert any(s.name.startswith("decoder.layers.2.") for s in three)


def test_preset_specs_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        preset_specs("gpt5")
    with pytest.raises(ValueError, match="layers must be a positive integer"):
        preset_specs("llama8b", layers=0)
    with pytest.raises(ValueError, match="hidden must be a positive integer"):
        transformer_specs(layers=1, hidden=0, heads=1, kv_heads=1, head_dim=1, ffn=1, vocab=1)


def test_specs_from_json_list_of_shapes():
    specs = specs_from_json([[4096, 4096], [4096], [3, 3, 8], []])
    assert [s.name for s in specs] == ["p0", "p1", "p2", "p3"]
    assert [s.shape for s in specs] == [(4096, 4096), (4096,), (3, 3, 8), ()]
    assert [s.is_muon for s in specs] == [True, False, False, False]


def test_specs_from_json_reads_every_fixture_params_list():
    for path in sorted(FIXTURES.glob("*.json")):
        doc = json.loads(path.read_text())
        for case in doc.get("cases", ()):
            specs = specs_from_json(case["params"])
            assert [s.name for s in specs] == [p["name"] for p in case["params"]]
            for spec, p in zip(specs, case["params"]):
                assert spec.shape == tuple(p["shape"]) and spec.dtype == p["dtype"]
                assert spec.is_shared_embedding == p["shared_embedding"]
                assert spec.is_expert == p["expert"]
                if "is_embedding_or_output_parameter" in p:
                    assert spec.is_muon == (
                        len(p["shape"]) == 2 and not p["is_embedding_or_output_parameter"]
                    )
            assert specs_from_json(case) == specs  # a whole case object works too


def test_specs_from_json_muon_flags():
    entry = {"name": "w", "shape": [4, 4], "dtype": "float32"}
    assert specs_from_json([entry])[0].is_muon
    assert not specs_from_json([{**entry, "is_embedding_or_output_parameter": True}])[0].is_muon
    assert not specs_from_json([{**entry, "is_muon": False}])[0].is_muon
    assert not specs_from_json([{**entry, "shared_embedding": True}])[0].is_muon
    assert not specs_from_json([{**entry, "name": "lm_head/kernel"}])[0].is_muon


def test_specs_to_json_round_trips():
    specs = preset_specs("moe", layers=1) + preset_specs("tied", layers=1)[:3]
    specs = list({s.name: s for s in specs}.values())
    assert specs_from_json(json.loads(json.dumps(specs_to_json(specs)))) == specs


@pytest.mark.parametrize(
    "doc, message",
    [
        ([], r"non-empty list"),
        ({"layers": []}, r"needs a 'params' list"),
        ("p0", r"non-empty list"),
        ([[4, 0]], r"params\[0\]: shape must be a list of positive integers"),
        ([[4, 4], [2.5]], r"params\[1\]: shape must be a list of positive integers"),
        ([[4, 4], {"name": "b", "shape": [4]}], r"params\[1\]: a spec is either all shapes"),
        ([4096, 4096], r"params\[0\]: each entry must be a shape"),
        ([{"shape": [4]}], r"params\[0\]: name must be a non-empty string"),
        ([{"name": "a", "shape": [4]}, {"name": "b"}], r"params\[1\] \(b\): shape is missing"),
        (
            [{"name": "a", "shape": [4]}, {"name": "a", "shape": [8]}],
            r"params\[1\] \(a\): duplicate",
        ),
        (
            [{"name": "a", "shape": [4], "shard": 1}],
            r"params\[0\] \(a\): unknown fields \['shard'\]",
        ),
        (
            [{"name": "a", "shape": [4], "expert": "yes"}],
            r"params\[0\] \(a\): expert must be true or false",
        ),
        (
            [{"name": "a", "shape": [4], "is_muon": True}],
            r"params\[0\] \(a\): a Muon parameter must be a 2-D",
        ),
        (
            [{"name": "a", "shape": [4, 4], "dtype": 3}],
            r"params\[0\] \(a\): dtype must be a dtype name",
        ),
        ([{"name": "a", "shape": "4x4"}], r"params\[0\] \(a\): shape must be a list"),
    ],
    ids=[
        "empty",
        "object_without_params",
        "not_a_list",
        "zero_dim",
        "float_dim",
        "mixed_forms",
        "bare_ints",
        "missing_name",
        "missing_shape",
        "duplicate_name",
        "unknown_field",
        "non_bool_flag",
        "muon_vector",
        "bad_dtype",
        "string_shape",
    ],
)
def test_specs_from_json_rejects_bad_entries(doc, message):
    with pytest.raises(ValueError, match=message):
        specs_from_json(doc)


def test_specs_are_param_specs():
    assert all(isinstance(s, ParamSpec) for s in preset_specs("llama1b", layers=1))
