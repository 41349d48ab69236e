"""Our Transformer as CTranslate2's ``TransformerSpec`` (its specification API,
``ctranslate2.specs``): ``model_spec`` fills one with a model's weights, ``unsupported`` says
which model configs it cannot describe exactly. ``python -m minitransformer.export`` (export.py)
saves the spec with the run's sentencepiece model; the benchmark uses ``model_spec`` directly.

Mapping (ours -> CTranslate2 TransformerSpec; our Linear weights are (in, out) and applied as
x W + b, CTranslate2's are (out, in), so every matrix is transposed):
    embedding (V, D) or src_embedding     encoder/embeddings_0/weight
    embedding or tgt_embedding            decoder/embeddings/weight
    embedding, or out_proj.weight^T       decoder/projection/weight (no bias); a shared
                                          matrix is stored once (CTranslate2 aliases it)
    x sqrt(D)                             scale_embeddings (CTranslate2's default, sqrt(D))
    sinusoid table or positions (P, D)    {encoder,decoder}/position_encodings/encodings
    encoder.{i}.self_attn.{wq,wk,wv}      encoder/layer_{i}/self_attention/linear_0: one
                                          (3D, D) matrix [Wq Wk Wv]^T, bias [bq bk bv]
    encoder.{i}.self_attn.wo              .../self_attention/linear_1
    encoder.{i}.sub1.norm                 .../self_attention/layer_norm
    encoder.{i}.ff.w1, ff.w2, sub2.norm   .../ffn/linear_0, linear_1, layer_norm (ReLU)
    decoder.{i}.self_attn, sub1.norm      decoder/layer_{i}/self_attention (as above)
    decoder.{i}.cross_attn.wq             .../attention/linear_0
    decoder.{i}.cross_attn.{wk,wv}        .../attention/linear_1: (2D, D) [Wk Wv]^T
    decoder.{i}.cross_attn.wo, sub2.norm  .../attention/linear_2, layer_norm
    decoder.{i}.ff, sub3.norm             .../ffn
    enc_norm, dec_norm (norm='pre')       encoder/layer_norm, decoder/layer_norm
    norm 'post' / 'pre'                   pre_norm=False / True: a sub-layer's layer_norm is
                                          applied after its residual add, or to its input
    ln_eps                                config.json layer_norm_epsilon (CTranslate2 reads it
                                          for every LayerNorm; unset it would be 1e-5)
    pad/unk/bos/eos ids                   their sentencepiece pieces as unk_token,
                                          bos_token (= decoder_start_token), eos_token
    EOS after the source                  add_source_eos=True: plain pieces go in
Positions: CTranslate2's own sinusoids are [sin | cos] with log-timescale increments
log(10000) / (D/2 - 1) and start at position 1, neither ours, so our table (either layout,
or the learned one) is written as the encodings. CTranslate2 adds row ``step + t`` to the t-th
input of a call: the source's first piece gets row 0, the decoder's BOS row 0 and the n-th
output token (fed at step n) row n, as in our model. The table has max_positions (P) rows, and
CTranslate2 refuses a longer input or output ("No position encodings are defined for
positions >= P"): export.translate_options passes max_input_length=P (a longer source is cut to its
first P - 1 pieces and EOS, as translation.py cuts ours) and a decoding length of at most P - 1.
"""
from __future__ import annotations

from typing import Any, Optional

# (NumPy is imported inside the functions: export.py's command line sets up the process,
# OPENBLAS_CORETYPE included, before NumPy loads)

KNOWN = {"norm": ("post", "pre"), "positions": ("sinusoidal", "learned"),
         "sinusoid_layout": ("interleaved", "concat")}
IGNORED = {"dropout", "attention_dropout", "relu_dropout", "label_smoothing", "smoothing"}
MAPPED = {"vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "norm", "positions",
          "sinusoid_layout", "max_positions", "share_embeddings", "ln_eps", "pad_id", "bos_id",
          "eos_id"}
INTEGERS = ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_positions", "pad_id",
            "bos_id", "eos_id")


def model_spec(model: Any, tok: Any, ct2: Any) -> Any:
    """Our Transformer ``model`` (its tokenizer ``tok``) -> a ctranslate2.specs.TransformerSpec
    holding its weights (float32; the module docstring lists the mapping)."""
    import numpy as np
    cfg, p = model.cfg, model.state_dict()
    spec = ct2.specs.TransformerSpec.from_config(
        num_layers=cfg.n_layers, num_heads=cfg.n_heads, pre_norm=cfg.norm == "pre",
        activation=ct2.specs.Activation.RELU)
    table = p["positions"] if cfg.positions == "learned" else np.asarray(model.pe)
    if cfg.share_embeddings:
        src, tgt, proj = p["embedding"], p["embedding"], p["embedding"]
    else:
        src, tgt, proj = p["src_embedding"], p["tgt_embedding"], p["out_proj.weight"].T
    spec.encoder.embeddings[0].weight = _array(src)
    spec.decoder.embeddings.weight = _array(tgt)
    spec.decoder.projection.weight = _array(proj)
    spec.encoder.position_encodings.encodings = _array(table)
    spec.decoder.position_encodings.encodings = _array(table)
    for i, layer in enumerate(spec.encoder.layer):
        _self_attention(layer.self_attention, p, f"encoder.{i}.self_attn", f"encoder.{i}.sub1")
        _ffn(layer.ffn, p, f"encoder.{i}.ff", f"encoder.{i}.sub2")
    for i, layer in enumerate(spec.decoder.layer):
        _self_attention(layer.self_attention, p, f"decoder.{i}.self_attn", f"decoder.{i}.sub1")
        _cross_attention(layer.attention, p, f"decoder.{i}.cross_attn", f"decoder.{i}.sub2")
        _ffn(layer.ffn, p, f"decoder.{i}.ff", f"decoder.{i}.sub3")
    if cfg.norm == "pre":
        _norm(spec.encoder.layer_norm, p, "enc_norm")
        _norm(spec.decoder.layer_norm, p, "dec_norm")
    _spec_config(spec.config, cfg, tok)
    _vocabulary(spec, tok)
    return spec


def _array(a):
    import numpy as np
    return np.ascontiguousarray(a, dtype=np.float32)


def _linear(spec, p, *names):
    """Our Linears ``names`` (weights (D, out_j)) side by side: x [W_1 W_2 ..] + [b_1 b_2 ..]
    -> CTranslate2's one Linear, weight (sum out_j, D) = [W_1 W_2 ..]^T."""
    import numpy as np
    spec.weight = _array(np.concatenate([p[f"{n}.weight"] for n in names], axis=1).T)
    spec.bias = _array(np.concatenate([p[f"{n}.bias"] for n in names]))


def _norm(spec, p, name):
    spec.gamma, spec.beta = _array(p[f"{name}.gamma"]), _array(p[f"{name}.beta"])


def _self_attention(spec, p, attn, sub):
    """linear_0: q, k and v in one product (their heads are K-column blocks in both); linear_1:
    the output projection; layer_norm: the norm of the sub-layer around it."""
    _linear(spec.linear[0], p, f"{attn}.wq", f"{attn}.wk", f"{attn}.wv")
    _linear(spec.linear[1], p, f"{attn}.wo")
    _norm(spec.layer_norm, p, f"{sub}.norm")


def _cross_attention(spec, p, attn, sub):
    """linear_0: queries from the decoder; linear_1: keys and values of the memory in one
    product; linear_2: the output projection."""
    _linear(spec.linear[0], p, f"{attn}.wq")
    _linear(spec.linear[1], p, f"{attn}.wk", f"{attn}.wv")
    _linear(spec.linear[2], p, f"{attn}.wo")
    _norm(spec.layer_norm, p, f"{sub}.norm")


def _ffn(spec, p, ff, sub):
    _linear(spec.linear_0, p, f"{ff}.w1")
    _linear(spec.linear_1, p, f"{ff}.w2")
    _norm(spec.layer_norm, p, f"{sub}.norm")


def _spec_config(config, cfg, tok):
    """CTranslate2's config.json: our LayerNorm epsilon, special tokens by their pieces, and
    the EOS our sources end with."""
    config.layer_norm_epsilon = float(cfg.ln_eps)
    config.unk_token = tok.id_to_piece(tok.unk_id)
    config.bos_token = tok.id_to_piece(cfg.bos_id)
    config.eos_token = tok.id_to_piece(cfg.eos_id)
    config.decoder_start_token = config.bos_token
    config.add_source_bos, config.add_source_eos = False, True


def _vocabulary(spec, tok):
    """The sentencepiece pieces in id order, for source and target (saved once, shared)."""
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)


def unsupported(config: dict) -> Optional[str]:
    """Why the model config ``config`` (a dict, as checkpoints store it) cannot be exported
    exactly, in one line naming the field, or None when it can."""
    unknown = sorted(set(config) - MAPPED - IGNORED)
    if unknown:
        return (f"config field {unknown[0]!r} is unknown to this exporter (a newer "
                "minitransformer?); export with the version that trained the model")
    for field in INTEGERS:
        if field in config and (not isinstance(config[field], int) or
                                isinstance(config[field], bool)):
            return (f"config field {field}={config[field]!r} is not an integer; the "
                    "checkpoint is damaged or not a minitransformer checkpoint")
    for field, allowed in KNOWN.items():
        if field in config and config[field] not in allowed:
            return (f"config field {field}={config[field]!r} has no CTranslate2 mapping "
                    f"(supported: {', '.join(allowed)}); export with the version that "
                    "trained the model")
    if config.get("n_layers", 1) < 1:
        return (f"config field n_layers={config['n_layers']}: CTranslate2 needs at least "
                "one encoder and one decoder layer; this model cannot be exported")
    if config.get("max_positions", 2) < 2:
        return (f"config field max_positions={config['max_positions']}: the position table "
                "is too short for a source piece and EOS; retrain with --max-positions >= 2")
    return _special_ids_problem(config)


def _special_ids_problem(config):
    ids = {k: config.get(k, d) for k, d in (("pad_id", 0), ("bos_id", 2), ("eos_id", 3))}
    V = config.get("vocab_size", 8000)
    for name, i in ids.items():
        if not 0 <= i < V:
            return (f"config field {name}={i} is outside the vocabulary (vocab_size {V}); "
                    "the checkpoint is damaged or not this run's")
    if len(set(ids.values())) < 3:
        return (f"config fields pad_id, bos_id, eos_id ({', '.join(map(str, ids.values()))}) "
                "must be three different ids for CTranslate2's special tokens; this model cannot "
                "be exported")
    return None
