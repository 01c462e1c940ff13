"""trainer export: every format round-trips into our drafter class with identical outputs, and loads in the
reference class wherever that class is installable here (``dflash``, ``speculators``, the TreeFlash
``trust_remote_code`` file); SGLang's loader is checked against its weight-name rules and config fields.

Drafters are built for a config-built 8-layer target (hidden 32) with randomised weights, norms included, so
a wrong key, transpose or norm shows in the outputs.
"""

import json
import time

import pytest
import torch
import yaml
from conftest import ROOT, TINY_TARGET, make_tiny_target
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from trainer.cli import main as cli_main
from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.drafters import load_drafter
from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.dflash import build_config as dflash_config
from trainer.drafters.eagle3 import Eagle3DraftModel
from trainer.drafters.eagle3 import build_config as eagle3_config
from trainer.drafters.specblock import SpecBlockDraftModel
from trainer.drafters.specblock import build_config as specblock_config
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.errors import UserError
from trainer.export import speculators, write_export
from trainer.export.source import load_source
from trainer.target import Target, decoder_layers

H = 32
BLOCK = 4
DRAFT_VOCAB = 300


def randomised(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.3 * torch.randn_like(param)
            param.copy_(1 + noise if "norm" in name else noise)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    config = make_tiny_target(root / "target")
    mask_id = AutoTokenizer.from_pretrained(TINY_TARGET).mask_token_id
    dflash = randomised(DFlashDraftModel(dflash_config(config, 2, BLOCK, mask_id, intermediate_size=48)))
    treeflash = randomised(TreeFlashDraftModel.from_dflash(dflash))
    eagle = randomised(Eagle3DraftModel(eagle3_config(config, DRAFT_VOCAB)))
    # A reduced vocabulary that is not the identity: draft id d -> target id 3d + 1.
    eagle.d2t.copy_(torch.arange(DRAFT_VOCAB) * 2 + 1)
    eagle.t2d.zero_()[torch.arange(DRAFT_VOCAB) * 3 + 1] = True
    specblock = randomised(SpecBlockDraftModel(specblock_config(config)))
    drafters = {"dflash": dflash, "treeflash": treeflash, "eagle3": eagle, "specblock": specblock}
    return root, drafters


def inputs(n_ctx: int = 7, seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "noise": torch.randn(2, BLOCK, H, generator=g),
        "features2": torch.randn(2, n_ctx, 2 * H, generator=g),
        "features3": torch.randn(2, n_ctx, 3 * H, generator=g),
        "embeds": torch.randn(2, n_ctx, H, generator=g),
        "prev": torch.randn(2, BLOCK, 5, H, generator=g),
        "ctx_positions": torch.arange(n_ctx).expand(2, -1),
        "positions": torch.arange(n_ctx + BLOCK).expand(2, -1),
    }


@torch.no_grad()
def outputs(drafter, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """What each family's forward gives for the same inputs (DFlash: normed block; TreeFlash: corrected for 5
    candidate previous tokens per slot; EAGLE-3: draft logits; SpecBlock: the context blocks' slots)."""
    if isinstance(drafter, TreeFlashDraftModel):
        hidden, normed = drafter.backbone(
            noise_embedding=x["noise"], target_hidden=x["features2"], position_ids=x["positions"]
        )
        expand = lambda t: t[:, :, None].expand_as(x["prev"])  # noqa: E731
        return drafter.correct(expand(hidden), expand(normed), x["prev"])
    if isinstance(drafter, DFlashDraftModel):
        return drafter(x["noise"], x["features2"], x["positions"])
    if isinstance(drafter, Eagle3DraftModel):
        return drafter.logits(drafter(drafter.fuse(x["features3"]), x["embeds"], x["ctx_positions"]))
    return drafter(drafter.project_features(x["features3"]), x["embeds"], x["ctx_positions"])


ROUND_TRIPS = [
    ("dflash", "dflash", DFlashDraftModel.from_pretrained),
    ("treeflash", "treeflash", TreeFlashDraftModel.from_pretrained),
    ("treeflash", "dflash", TreeFlashDraftModel.from_pretrained),
    ("sglang", "eagle3", Eagle3DraftModel.from_pretrained),
    ("specblock", "specblock", SpecBlockDraftModel.from_pretrained),
    ("speculators", "dflash", speculators.load),
    ("speculators", "eagle3", speculators.load),
]


@pytest.mark.parametrize("fmt,family,load", ROUND_TRIPS)
def test_round_trip_gives_identical_outputs(setup, tmp_path, fmt, family, load):
    root, drafters = setup
    drafter = drafters[family]
    out = write_export(drafter, fmt, tmp_path / fmt, verifier=str(root / "target"))
    back = load(out).eval()
    # The outputs below take the features as given; the layer ids say which target layers they come from.
    assert back.target_layer_ids == drafter.target_layer_ids
    x = inputs()
    if family == "dflash" and fmt == "treeflash":
        # A DFlash drafter exported as TreeFlash has an identity approximator: its corrections are its marginals.
        torch.testing.assert_close(outputs(back, x), outputs(drafter, x)[:, :, None].expand_as(x["prev"]))
        return
    assert type(back) is type(drafter)
    torch.testing.assert_close(outputs(back, x), outputs(drafter, x), rtol=0, atol=0)


def test_treeflash_backbone_exports_as_dflash(setup, tmp_path):
    _, drafters = setup
    out = write_export(drafters["treeflash"], "dflash", tmp_path / "dflash")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "treeflash_config" not in config
    back = DFlashDraftModel.from_pretrained(out).eval()
    x = inputs()
    normed = drafters["treeflash"].backbone(
        noise_embedding=x["noise"], target_hidden=x["features2"], position_ids=x["positions"]
    )[1]
    torch.testing.assert_close(outputs(back, x), normed, rtol=0, atol=0)


@torch.no_grad()
def test_dflash_export_loads_in_the_dflash_package_and_drafts_the_same(tmp_path, monkeypatch):
    dflash_model = pytest.importorskip("dflash.model")
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # it times with CUDA synchronisation
    out = tmp_path / "dflash"
    cli_main(["export", str(ROOT / "checkpoints" / "dflash_tiny"), "--format", "dflash", "--out", str(out)])
    reference = dflash_model.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_drafter(ROOT / "checkpoints" / "dflash_tiny")
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    lines = (ROOT / "data" / "prompts" / "stdlib_heldout.jsonl").read_text().splitlines()[1:3]
    for line in lines:
        prompt = torch.tensor(tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"][-64:])
        ref = dflash_model.dflash_generate(reference, target, prompt[None], 32, stop_token_ids=None, return_stats=True)
        mine = generate(target, make_session("chain", target, ours), BUILDERS["chain"], prompt, 32, budget=15)
        assert mine.tokens == ref.output_ids[0, prompt.numel() :].tolist()
        assert [s.committed for s in mine.steps] == ref.acceptance_lengths
        assert max(ref.acceptance_lengths) > 1  # the drafts were accepted, so they were compared


@torch.no_grad()
def test_treeflash_export_loads_through_automodel_trust_remote_code(setup, tmp_path):
    _, drafters = setup
    out = write_export(drafters["treeflash"], "treeflash", tmp_path / "treeflash")
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_treeflash.TreeFlashDraftModel"}
    assert config["treeflash_config"] == {"ar_approximation": "swiglu", "candidate_tokens": 16}
    assert config["dflash_config"]["target_layer_ids"] == drafters["treeflash"].model.target_layer_ids
    keys = set(load_file(out / "model.safetensors"))
    assert {"ar_approximation.ug.weight", "ar_approximation.ug.bias", "ar_approximation.d.weight"} <= keys
    assert {"ar_approximation.norm.weight", "model.fc.weight", "model.hidden_norm.weight", "model.norm.weight"} <= keys

    remote, info = AutoModel.from_pretrained(out, trust_remote_code=True, output_loading_info=True)
    assert not any(info.values()), info
    assert type(remote).__module__.endswith("modeling_treeflash") and remote.block_size == BLOCK
    x = inputs()
    kwargs = {"position_ids": x["positions"], "noise_embedding": x["noise"], "target_hidden": x["features2"]}
    ours = drafters["treeflash"]
    torch.testing.assert_close(remote.eval()(**kwargs), ours.backbone(**kwargs)[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(remote(**kwargs, prev_token_embds=x["prev"]), outputs(ours, x), rtol=0, atol=1e-6)


def speculators_model(path, kind):
    models = pytest.importorskip("speculators.models")
    config_class = {"dflash": models.DFlashSpeculatorConfig, "eagle3": models.Eagle3SpeculatorConfig}[kind]
    config = config_class.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"  # its default is flex attention
    model_class = {"dflash": models.DFlashDraftModel, "eagle3": models.Eagle3DraftModel}[kind]
    model = model_class.from_pretrained(path, config=config)
    # The embedding (and for full-vocabulary drafts the LM head) is the verifier's, read from its directory.
    model.load_verifier_weights()
    state = model.state_dict()
    for name, tensor in load_file(path / "model.safetensors").items():
        assert name in state and torch.equal(state[name], tensor), f"{name} did not load"
    # Anything neither in the file nor the verifier's would still hold speculators' NaN (or a random) init.
    assert not any(t.isnan().any() for t in state.values() if t.is_floating_point())
    assert set(state) - set(load_file(path / "model.safetensors")) <= {
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    return model.eval()


@torch.no_grad()
def test_speculators_dflash_export_loads_in_speculators(setup, tmp_path):
    root, drafters = setup
    out = write_export(drafters["dflash"], "speculators", tmp_path / "spec", verifier=str(root / "target"))
    reference = speculators_model(out, "dflash")
    assert reference.config.aux_hidden_state_layer_ids == [i + 1 for i in drafters["dflash"].target_layer_ids]
    assert (reference.block_size, reference.mask_token_id) == (BLOCK, drafters["dflash"].mask_token_id)
    x = inputs()
    context = reference.hidden_norm(reference.fc(x["features2"]))
    cos_sin = reference.rotary_emb(x["noise"], x["positions"])
    hidden = x["noise"]
    for layer in reference.layers:
        hidden = layer(
            hidden_states=hidden,
            target_hidden=context,
            attention_mask=None,
            position_ids=x["positions"],
            position_embeddings=cos_sin,
        )
    torch.testing.assert_close(reference.norm(hidden), outputs(drafters["dflash"], x), rtol=0, atol=1e-5)
    target = AutoModelForCausalLM.from_pretrained(root / "target")
    assert torch.equal(reference.embed_tokens.weight, target.get_input_embeddings().weight)


@torch.no_grad()
def test_speculators_eagle3_export_loads_in_speculators(setup, tmp_path):
    root, drafters = setup
    eagle = drafters["eagle3"]
    out = write_export(eagle, "speculators", tmp_path / "spec", verifier=str(root / "target"))
    reference = speculators_model(out, "eagle3")
    assert torch.equal(reference.d2t, eagle.d2t) and torch.equal(reference.t2d, eagle.t2d)
    ids = torch.randint(0, 8000, (1, 9))
    features = inputs(9)["features3"][:1]
    logits = []
    reference.lm_head.register_forward_hook(lambda module, args, output: logits.append(output))
    drafts = reference(
        hidden_states=features,
        input_ids=ids,
        document_ids=torch.ones_like(ids),
        position_ids=torch.arange(9)[None],
        ttt_steps=1,
    )
    embeds = reference.embed_tokens(ids)
    ours = eagle.logits(eagle(eagle.fuse(features), embeds, torch.arange(9)[None]))
    torch.testing.assert_close(logits[0], ours, rtol=0, atol=1e-5)
    assert torch.equal(drafts[0], ours.argmax(-1))


def test_sglang_export_fits_llama_for_causal_lm_eagle3(setup, tmp_path):
    """SGLang builds ``model.{embed_tokens, fc, midlayer.{self_attn.qkv_proj, ...}, norm}`` and ``lm_head``
    from config.json and loads a key into ``name`` or ``model.name`` after stacking q/k/v and gate/up; ``d2t``
    becomes its hot-token map ``d2t + arange`` and ``t2d`` is skipped."""
    _, drafters = setup
    eagle = drafters["eagle3"]
    out = write_export(eagle, "sglang", tmp_path / "sglang", dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["rope_theta"] > 0
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    h, heads, kv, d, inter = 32, 4, 2, 8, config["intermediate_size"]
    sglang_params = {
        "model.fc.weight": (h, 3 * h),
        "model.midlayer.self_attn.qkv_proj.weight": ((heads + 2 * kv) * d, 2 * h),
        "model.midlayer.self_attn.o_proj.weight": (h, heads * d),
        "model.midlayer.mlp.gate_up_proj.weight": (2 * inter, h),
        "model.midlayer.mlp.down_proj.weight": (h, inter),
        "model.midlayer.input_layernorm.weight": (h,),
        "model.midlayer.hidden_norm.weight": (h,),
        "model.midlayer.post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (DRAFT_VOCAB, h),
    }
    stacked = {
        ".q_proj": ".qkv_proj",
        ".k_proj": ".qkv_proj",
        ".v_proj": ".qkv_proj",
        ".gate_proj": ".gate_up_proj",
        ".up_proj": ".gate_up_proj",
    }
    filled: dict[str, int] = {}
    hot = None
    for name, tensor in load_file(out / "model.safetensors").items():
        if "d2t" in name:
            hot = tensor + torch.arange(tensor.shape[0])
            continue
        if "t2d" in name:
            continue
        assert tensor.dtype == torch.bfloat16
        for shard, param in stacked.items():
            name = name.replace(shard, param)
        param = name if name in sglang_params else f"model.{name}"
        assert param in sglang_params, f"SGLang has no parameter for {name}"
        rows = tensor.shape[0]
        assert tensor.shape[1:] == sglang_params[param][1:], name
        filled[param] = filled.get(param, 0) + rows
    assert filled == {k: v[0] for k, v in sglang_params.items()}
    assert torch.equal(hot, eagle.to_target(torch.arange(DRAFT_VOCAB)))


# ---- which target layers an engine feeds an exported drafter -------------------------------------------------
# Each engine's capture rule, reimplemented from its code (quoted beside each), on the shipped target, whose layers'
# outputs all differ: the features an engine gathers for the key it reads must be those the drafter was trained on
# (trainer.target.Target over the drafter's target_layer_ids).


@torch.no_grad()
def residual_stream(model, ids: torch.Tensor, entering=(), leaving=()) -> torch.Tensor:
    """One forward of ``model``: in layer order, the hidden state entering each decoder layer in ``entering`` and
    leaving each in ``leaving``, concatenated. Shape: (B, T, n * H)"""
    captured: list[torch.Tensor] = []

    def before(module, args, kwargs):
        captured.append(args[0] if args else kwargs["hidden_states"])

    def after(module, args, output):
        captured.append(output[0] if isinstance(output, tuple) else output)

    layers = decoder_layers(model)
    handles = [layers[i].register_forward_pre_hook(before, with_kwargs=True) for i in entering]
    handles += [layers[i].register_forward_hook(after) for i in leaving]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(captured, dim=-1)


def sglang_reads(model, key: list[int], ids: torch.Tensor) -> torch.Tensor:
    # sglang 0.5.23 srt/models/qwen3.py set_eagle3_layers_to_capture and set_dflash_layers_to_capture:
    # `layers_to_capture = [val + 1 for val in layer_ids]`; the layer loop captures the stream entering layer i
    # for each i in layers_to_capture.
    layers_to_capture = [val + 1 for val in key]
    return residual_stream(
        model, ids, entering=[i for i in range(len(decoder_layers(model))) if i in layers_to_capture]
    )


def vllm_reads(model, key: list[int], ids: torch.Tensor) -> torch.Tensor:
    # vllm 0.32: after layer layer_idx, `if layer_idx + 1 in self.aux_hidden_state_layers:
    # aux_hidden_states.append(hidden_states)`; the speculators key is eagle_aux_hidden_state_layer_ids unchanged
    # (transformers_utils/configs/speculators/algos.py update_eagle3, update_dflash).
    aux_hidden_state_layers = list(key)
    layers = range(len(decoder_layers(model)))
    return residual_stream(model, ids, leaving=[i for i in layers if i + 1 in aux_hidden_state_layers])


def vllm_reads_dflash(model, key: list[int], ids: torch.Tensor) -> torch.Tensor:
    # vllm v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config: without
    # eagle_aux_hidden_state_layer_ids, `[i + 1 for i in dflash_config["target_layer_ids"]]`, then as above.
    return vllm_reads(model, [i + 1 for i in key], ids)


@torch.no_grad()
def dflash_package_reads(model, key: list[int], ids: torch.Tensor) -> torch.Tensor:
    """The ``dflash`` package's own ``extract_context_feature`` (TreeFlash's ``tree_flash.py`` has the same one:
    ``hidden_states[layer_id + 1]``)."""
    dflash_model = pytest.importorskip("dflash.model")
    return dflash_model.extract_context_feature(model(input_ids=ids, output_hidden_states=True).hidden_states, key)


ENGINE_BOUNDARIES = [
    # (shipped drafter, --format, the key's path in config.json, the engine's rule)
    ("eagle3_tiny", "sglang", ("eagle_config", "eagle_aux_hidden_state_layer_ids"), sglang_reads),
    ("eagle3_tiny", "speculators", ("eagle_aux_hidden_state_layer_ids",), vllm_reads),
    ("dflash_tiny", "speculators", ("aux_hidden_state_layer_ids",), vllm_reads),
    ("dflash_tiny", "dflash", ("dflash_config", "target_layer_ids"), sglang_reads),
    ("dflash_tiny", "dflash", ("dflash_config", "target_layer_ids"), vllm_reads_dflash),
    ("dflash_tiny", "dflash", ("dflash_config", "target_layer_ids"), dflash_package_reads),
    ("treeflash_tiny", "treeflash", ("dflash_config", "target_layer_ids"), dflash_package_reads),
]
READERS = {"sglang": load_drafter, "dflash": load_drafter, "treeflash": load_drafter, "speculators": speculators.load}


@pytest.mark.parametrize(
    "name,fmt,key_path,engine_reads",
    ENGINE_BOUNDARIES,
    ids=[f"{b[0]}-{b[1]}-{b[3].__name__}" for b in ENGINE_BOUNDARIES],
)
def test_the_engine_feeds_the_drafter_the_layers_it_was_trained_on(tmp_path, name, fmt, key_path, engine_reads):
    drafter = load_drafter(ROOT / "checkpoints" / name)
    out = tmp_path / fmt
    cli_main(["export", str(ROOT / "checkpoints" / name), "--format", fmt, "--out", str(out)])
    key = json.loads((out / "config.json").read_text())
    for field in key_path:
        key = key[field]
    trained = Target.from_pretrained(str(TINY_TARGET), drafter.target_layer_ids)
    ids = torch.randint(0, trained.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    states = trained.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert all(not torch.equal(a, b) for i, a in enumerate(states) for b in states[i + 1 :])
    torch.testing.assert_close(engine_reads(trained.model, key, ids), trained(ids, with_logits=False).features)
    # Reading the directory back gives the drafter its own layers again.
    assert READERS[fmt](out).target_layer_ids == drafter.target_layer_ids
    if name == "eagle3_tiny":
        # Trained on the outputs of layers [1, 3, 4]: SGLang names them so, vLLM as HF hidden_states indices.
        assert key == {"sglang": [1, 3, 4], "speculators": [2, 4, 5]}[fmt]


@pytest.mark.parametrize("fmt,engine_reads", [("sglang", sglang_reads), ("speculators", vllm_reads)])
def test_a_third_party_eagle3_directory_reads_as_its_engine_would(tmp_path, fmt, engine_reads):
    """A drafter trained elsewhere on target layers [0, 2, 6] (not our default), in SGLang's or speculators'
    layout: reading it (``init_from``, ``trainer eval``) gives the layers its engine would feed it."""
    drafter = load_drafter(ROOT / "checkpoints" / "eagle3_tiny")
    out = write_export(drafter, fmt, tmp_path / fmt)
    config = json.loads((out / "config.json").read_text())
    key = {"sglang": [0, 2, 6], "speculators": [1, 3, 7]}[fmt]
    if fmt == "sglang":
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = key
    else:
        config["eagle_aux_hidden_state_layer_ids"] = key
    (out / "config.json").write_text(json.dumps(config))
    back = READERS[fmt](out)
    assert back.target_layer_ids == [0, 2, 6]
    trained = Target.from_pretrained(str(TINY_TARGET), back.target_layer_ids)
    ids = torch.randint(0, trained.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(engine_reads(trained.model, key, ids), trained(ids, with_logits=False).features)


def test_wrong_family_and_bad_sources_are_clear_errors(setup, tmp_path):
    _, drafters = setup
    with pytest.raises(UserError, match="--format sglang takes Eagle3DraftModel, not DFlashDraftModel"):
        write_export(drafters["dflash"], "sglang", tmp_path / "x")
    with pytest.raises(UserError, match="exports as: specblock"):
        write_export(drafters["specblock"], "speculators", tmp_path / "x")
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
    with pytest.raises(UserError, match="does not exist"):
        load_source(tmp_path / "nothing")
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable Lightning checkpoint"):
        load_source(tmp_path / "bad.ckpt")
    # A checkpoint without its drafter config is refused by name, even inside a run whose hf/ has a config.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    drafters["dflash"].save_pretrained(run / "hf")
    state = {f"drafter.{k}": v for k, v in drafters["dflash"].state_dict().items()}
    torch.save({"state_dict": state}, run / "checkpoints" / "foreign.ckpt")
    with pytest.raises(UserError, match=r"foreign\.ckpt holds no drafter config"):
        load_source(run / "checkpoints" / "foreign.ckpt")


def test_checkpoint_and_run_directory_sources(setup, tmp_path):
    """A .ckpt rebuilds the drafter from the config saved beside its weights; a run directory gives its newest
    hf/ export and the recipe's target; re-exporting replaces the directory whole."""
    root, drafters = setup
    eagle = drafters["eagle3"]
    run = tmp_path / "run" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    checkpoint = {
        "state_dict": {f"drafter.{k}": v for k, v in eagle.state_dict().items()},
        "drafter_config": eagle.config.to_dict(),
        "hyper_parameters": {"target": str(root / "target")},
    }
    torch.save(checkpoint, run / "checkpoints" / "last.ckpt")
    source = load_source(run / "checkpoints" / "last.ckpt")
    assert source.target == str(root / "target")
    torch.testing.assert_close(outputs(source.drafter, inputs()), outputs(eagle, inputs()), rtol=0, atol=0)

    eagle.save_pretrained(run / "hf")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"init_args": {"target": str(root / "target")}}}))
    out = tmp_path / "out"
    for _ in range(2):
        cli_main(["export", str(tmp_path / "run"), "--format", "speculators", "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(root / "target"),
        "architectures": ["Qwen3ForCausalLM"],
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
