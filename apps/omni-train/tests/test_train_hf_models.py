"""Hugging Face interop per model family, ``transformers`` as the oracle (float32, tolerance 1e-5).

Models are built from configs locally (random init, no hub). For each family: our model loaded from a
folder ``save_pretrained`` wrote (sharded with an index for the LLM) computes ``transformers``' forward;
our model exported (:func:`omni_train.hf.write_folder` of the adapter's ``to_hf``) loads with
``from_pretrained`` and computes ours. Norm weights and biases are randomised too, so no mapping can hide
behind an init of ones or zeros.
"""

import os

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from hf_oracle import TOL, assert_close_at_tol, perturb  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLVisionConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel  # noqa: E402
from transformers.models.whisper.modeling_whisper import WhisperEncoder  # noqa: E402

from omni_train.hf import (  # noqa: E402
    HFFolderError,
    LlamaAdapter,
    Qwen2VLVisionAdapter,
    WhisperEncoderAdapter,
    audio_config_from_hf,
    llm_config_from_hf,
    read_config,
    read_weights,
    vit_config_from_hf,
    write_folder,
)
from omni_train.models import AudioConfig, AudioEncoder, ImageTower, LLMStage, log_mel, patchify  # noqa: E402
from omni_train.models.audio import mel_filterbank  # noqa: E402

# -- LLM -------------------------------------------------------------------------------------------------------
LLM_SIZES = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    initializer_range=0.1,
)
LLM_CASES = [
    (LlamaForCausalLM, LlamaConfig(**LLM_SIZES, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    (Qwen2ForCausalLM, Qwen2Config(**LLM_SIZES, rms_norm_eps=1e-6, tie_word_embeddings=True)),
]  # fmt: skip


def _packed_vs_batched(ours: LLMStage, hf_model, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits over three documents packed into one sequence, and the HF model's on each alone."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 11, 7]
    docs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    pos = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = ours(torch.cat(docs), pos, cu)
        alone = torch.cat([hf_model(input_ids=d[None]).logits[0] for d in docs])
    return packed, alone


@pytest.mark.parametrize(("cls", "hf_cfg"), LLM_CASES, ids=["llama", "qwen2-tied"])
def test_llm_from_hf_folder_equals_transformers_and_export_loads(tmp_path, cls, hf_cfg):
    torch.manual_seed(0)
    hf_model = cls(hf_cfg).eval()
    perturb(hf_model, 1)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # sharded: the index is read

    cfg = llm_config_from_hf(read_config(tmp_path / "hf"), vocab_size=97)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.n_layers) == (8, 2, 3)
    assert cfg.qkv_bias == (cls is Qwen2ForCausalLM) and cfg.tie_embeddings == hf_cfg.tie_word_embeddings
    ours = LLMStage(cfg)
    adapter = LlamaAdapter(cfg)
    ours.load_state_dict(adapter.from_hf(read_weights(tmp_path / "hf")), strict=True)
    assert_close_at_tol(*_packed_vs_batched(ours, hf_model, 2))

    # export: our seeded model (biases and norms randomised) -> folder -> from_pretrained
    mine = LLMStage(cfg, seed=7)
    perturb(mine, 3)
    files = write_folder(
        tmp_path / "out", adapter.hf_config(), adapter.to_hf(mine.state_dict()), max_shard_bytes=30_000
    )
    assert len(files) > 1
    loaded = cls.from_pretrained(tmp_path / "out").eval()
    assert type(loaded) is cls
    assert_close_at_tol(*_packed_vs_batched(mine, loaded, 4))


def test_llm_import_refuses_what_it_cannot_represent(tmp_path):
    base = LLM_CASES[0][1].to_dict()
    for key, value, match in [
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "rope scaling"),
        ("attention_bias", True, "attention_bias"),
        ("hidden_act", "gelu", "hidden_act"),
        ("head_dim", 16, "head_dim"),
    ]:
        with pytest.raises(HFFolderError, match=match):
            llm_config_from_hf({**base, key: value})
    with pytest.raises(HFFolderError, match="vocab_size 97 differs"):
        llm_config_from_hf(base, vocab_size=400)
    with pytest.raises(HFFolderError, match="model_type 'bert'"):
        llm_config_from_hf({**base, "model_type": "bert"})


# -- vision ------------------------------------------------------------------------------------------------------
def _vision_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two images of different shapes: our patches/grids, and Qwen2-VL's (frames repeated over time)."""
    g = torch.Generator().manual_seed(seed)
    parts = [patchify(torch.randn(3, h, w, generator=g), 14, 2) for h, w in ((56, 84), (28, 56))]
    patches = torch.cat([p for p, _ in parts])
    grids = torch.tensor([gr for _, gr in parts])
    hf_patches = patches.view(-1, 3, 1, 14, 14).expand(-1, -1, 2, -1, -1).reshape(patches.shape[0], -1)
    thw = torch.tensor([[1, h, w] for h, w in grids.tolist()])
    return patches, grids, hf_patches, thw


def test_vision_tower_from_hf_folder_equals_qwen2vl_and_export_loads(tmp_path):
    torch.manual_seed(0)
    hf_cfg = Qwen2VLVisionConfig(
        depth=3,
        embed_dim=32,
        hidden_size=48,
        num_heads=4,
        hidden_act="quick_gelu",
        initializer_range=0.1,
        rope_parameters={"rope_type": "axial", "rope_theta": 1000.0},
    )
    hf_model = Qwen2VisionTransformerPretrainedModel(hf_cfg).eval()
    perturb(hf_model, 1)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg, llm_dim = vit_config_from_hf(read_config(tmp_path / "hf"))
    assert llm_dim == 48 and cfg.projector_hidden == 128 and not cfg.patch_bias
    tower = ImageTower(cfg, llm_dim)
    adapter = Qwen2VLVisionAdapter(cfg, llm_dim)
    tower.load_state_dict(adapter.from_hf(read_weights(tmp_path / "hf")), strict=True)
    patches, grids, hf_patches, thw = _vision_inputs(2)
    with torch.no_grad():
        ref = hf_model(hf_patches, grid_thw=thw)
        assert_close_at_tol(tower(patches, grids), ref.pooler_output)  # merged tokens at the LLM width
        # the ViT alone: its final norm is the merger's ln_q, applied before the 2x2 merge
        assert_close_at_tol(
            tower.encoder(patches, grids), hf_model.merger.ln_q(ref.last_hidden_state).reshape(-1, 128)
        )

    mine = ImageTower(cfg, llm_dim, seed=5)
    perturb(mine, 3)
    write_folder(tmp_path / "out", adapter.hf_config(), adapter.to_hf(mine.state_dict()))
    loaded = Qwen2VisionTransformerPretrainedModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert_close_at_tol(mine(patches, grids), loaded(hf_patches, grid_thw=thw).pooler_output)


# -- audio -------------------------------------------------------------------------------------------------------
def test_audio_encoder_from_hf_folder_equals_whisper_and_export_loads(tmp_path):
    torch.manual_seed(0)
    hf_cfg = WhisperConfig(
        d_model=32,
        encoder_layers=3,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=12,
        init_std=0.1,
    )
    hf_model = WhisperEncoder(hf_cfg).eval()
    fresh_positions = hf_model.embed_positions.weight.detach().clone()
    perturb(hf_model, 1)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = audio_config_from_hf(read_config(tmp_path / "hf"))
    enc = AudioEncoder(cfg)
    torch.testing.assert_close(enc.pos_embed, fresh_positions, rtol=0, atol=0)  # Whisper's sinusoids
    adapter = WhisperEncoderAdapter(cfg)
    enc.load_state_dict(adapter.from_hf(read_weights(tmp_path / "hf")), strict=True)
    # Whisper needs exactly 2 * max_source_positions frames per clip; ours packs the three clips
    mels = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(2))
    packed = mels.transpose(1, 2).reshape(-1, 16)
    with torch.no_grad():
        assert_close_at_tol(
            enc(packed, torch.tensor([24, 24, 24])), hf_model(mels).last_hidden_state.reshape(-1, 32)
        )

    mine = AudioEncoder(cfg, seed=5)
    perturb(mine, 3)  # the key third of the fused bias too: Whisper drops it, softmax ignores it
    write_folder(tmp_path / "out", adapter.hf_config(), adapter.to_hf(mine.state_dict()))
    loaded = WhisperEncoder.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert_close_at_tol(
            mine(packed, torch.tensor([24, 24, 24])), loaded(mels).last_hidden_state.reshape(-1, 32)
        )


def test_slaney_log_mel_equals_whisper_feature_extractor():
    from transformers.audio_utils import mel_filter_bank

    ref_fb = mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=80,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
    )
    np.testing.assert_allclose(mel_filterbank(80, 400, 16000, "slaney").numpy(), ref_fb, rtol=0, atol=1e-15)
    t = np.arange(32000) / 16000
    wave = (0.3 * np.sin(2 * np.pi * 440 * t) * np.linspace(0.2, 1.0, t.size) ** 2).astype(np.float32)
    wave[-4000:] *= 0.01  # the maximum (the dynamic-range clamp's anchor) is not in the last frame
    ours = log_mel(torch.from_numpy(wave), AudioConfig(n_mels=80, mel_scale="slaney"))
    ref = WhisperFeatureExtractor(feature_size=80)._torch_extract_fbank_features(wave)
    # the feature extractor drops the STFT's last frame; ours keeps it (audio.py docstring)
    assert ours.shape == (ref.shape[1] + 1, 80)
    np.testing.assert_allclose(ours[:-1].numpy().T, ref, rtol=0, atol=TOL)


def test_towers_inside_full_checkpoints_are_found_and_the_rest_counted(tmp_path):
    """A full Qwen2-VL checkpoint holds the vision tower under ``visual.``, a full Whisper one the encoder
    under ``model.encoder.``: the towers load from there, every other tensor is reported unused."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, WhisperForConditionalGeneration

    from omni_train.hf import read_family

    torch.manual_seed(0)
    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4}
    vision = dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, initializer_range=0.1)
    vlm = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision)).eval()
    vlm.save_pretrained(tmp_path / "vlm")
    cfg, llm_dim = vit_config_from_hf(read_config(tmp_path / "vlm"))  # the full config's vision_config
    ours, unused = read_family(Qwen2VLVisionAdapter(cfg, llm_dim), tmp_path / "vlm")
    assert unused and all(not k.startswith("visual.") for k in unused)
    assert "lm_head.weight" in unused
    tower = ImageTower(cfg, llm_dim)
    tower.load_state_dict(ours, strict=True)
    patches, grids, hf_patches, thw = _vision_inputs(5)
    with torch.no_grad():
        assert_close_at_tol(tower(patches, grids), vlm.model.visual(hf_patches, grid_thw=thw).pooler_output)

    whisper = WhisperForConditionalGeneration(
        WhisperConfig(
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=8, vocab_size=100,
            max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
            begin_suppress_tokens=None, init_std=0.2,
        )
    ).eval()  # fmt: skip
    whisper.save_pretrained(tmp_path / "whisper")
    acfg = audio_config_from_hf(read_config(tmp_path / "whisper"))
    ours, unused = read_family(WhisperEncoderAdapter(acfg), tmp_path / "whisper")
    assert unused and all("decoder" in k or k == "proj_out.weight" for k in unused)
    enc = AudioEncoder(acfg)
    enc.load_state_dict(ours, strict=True)
    mels = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = whisper.model.encoder(mels).last_hidden_state[0]
        assert_close_at_tol(enc(mels[0].T.contiguous(), torch.tensor([16])), ref)
