"""llama.cpp as the bench's peer baseline (the optional extra ``llama``: ``pip install -e '.[llama]'``).

The mixtral-shape model is written to GGUF here, from its transformers checkpoint, with the ``gguf``
package's writer: llama.cpp's ``llama`` architecture with experts (``ffn_{gate,up,down}_exps``), the query
and key rows reordered from transformers' rotate-half layout to llama.cpp's interleaved one, and a
SentencePiece-type vocabulary naming the character tokenizer's ids (the bench feeds token ids, never
text). The float32 file is checked against transformers' logits on the prompt before anything is timed
(``logit_check``); the 4-bit file comes from it through ``llama_model_quantize``.

llama.cpp runs with an f32 KV cache (with the default f16 cache its greedy output leaves transformers' at
about token 8), its weight repacking off (``use_extra_bufts``: the repacked copy does not fit the
budget), its weights memory-mapped, and the process inside a memory cgroup (v1) whose limit is the
budget plus ``CGROUP_HEADROOM``; the page cache counts against the limit, so the mapped experts beyond
it are read from disk again as they are needed, which is what llama.cpp does when a model does not fit.
It cannot replay routing: it runs the model's own routers, against the loader doing the same
(``mixtral-shape-own``).
"""

from __future__ import annotations

import os
from pathlib import Path

from prep.errors import MoeprepError

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
CGROUP_HEADROOM = 64 << 20  # the interpreter, llama.cpp's compute buffers and KV cache, beside the budget
QUANT = "Q4_0"


def missing() -> str | None:
    """Why the llama.cpp baseline cannot run here, or None."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return (f"llama.cpp skipped: {e.name} is not installed (pip install -e '.[llama]'; llama-cpp-python "
                "builds from source, about 20 minutes on 2 cores)")
    if not (CGROUP_ROOT / "cgroup.procs").is_file() or not os.access(CGROUP_ROOT, os.W_OK):
        return f"llama.cpp skipped: no writable memory cgroup (v1) at {CGROUP_ROOT} to hold it to the budget"
    return None


def _rotary_rows(weight, heads: int):
    """transformers' rotate-half row order of a query or key projection -> llama.cpp's interleaved pairs."""
    out_features, in_features = weight.shape
    half = out_features // heads // 2
    return weight.reshape(heads, 2, half, in_features).swapaxes(1, 2).reshape(out_features, in_features)


def _vocabulary(size: int) -> tuple[list[bytes], list[int]]:
    """Token strings and types for the character tokenizer's ids (``subjects.char_tokenizer``): specials,
    the printable characters (a space as SentencePiece's U+2581), and byte tokens for the unused ids."""
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tokens, types = list(specials), [2, 3, 3, 3]  # unknown, control x3
    for c in range(32, 127):
        if len(tokens) == size:
            break
        tokens.append("\u2581" if c == 32 else chr(c))
        types.append(1)
    byte = 0
    while len(tokens) < size:
        tokens.append(f"<0x{byte:02X}>")
        types.append(6)
        byte += 1
    return [t.encode() for t in tokens], types


def write_gguf(model_dir: Path, path: Path) -> Path:
    """The transformers Mixtral checkpoint in ``model_dir`` as a float32 GGUF at ``path`` (written atomically)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type != "mixtral":
        raise MoeprepError(f"the llama.cpp converter handles the mixtral-shape model only, not {config.model_type}")
    state = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        state |= load_file(str(shard))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 1e6))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types = _vocabulary(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)

    def put(name, tensor):
        writer.add_tensor(name, np.ascontiguousarray(tensor.float().numpy()))

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    put("output.weight", state.get("lm_head.weight", state["model.embed_tokens.weight"]))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", _rotary_rows(state[p + "self_attn.q_proj.weight"], config.num_attention_heads))
        put(f"blk.{i}.attn_k.weight", _rotary_rows(state[p + "self_attn.k_proj.weight"], config.num_key_value_heads))
        put(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_gate_inp.weight", state.get(p + "mlp.gate.weight", state.get(p + "block_sparse_moe.gate.weight")))
        gate, up = _experts(state, p, config)
        put(f"blk.{i}.ffn_gate_exps.weight", gate)
        put(f"blk.{i}.ffn_up_exps.weight", up)
        put(f"blk.{i}.ffn_down_exps.weight", _down(state, p, config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


def _experts(state: dict, prefix: str, config):
    """(gate [E, I, H], up [E, I, H]) from either the fused or the per-expert checkpoint naming."""
    import torch

    fused = state.get(prefix + "mlp.experts.gate_up_proj")
    if fused is not None:
        return fused[:, :config.intermediate_size], fused[:, config.intermediate_size:]
    per = prefix + "block_sparse_moe.experts.{}.{}.weight"
    experts = range(config.num_local_experts)
    return (torch.stack([state[per.format(e, "w1")] for e in experts]),
            torch.stack([state[per.format(e, "w3")] for e in experts]))


def _down(state: dict, prefix: str, config):
    import torch

    fused = state.get(prefix + "mlp.experts.down_proj")
    if fused is not None:
        return fused
    per = prefix + "block_sparse_moe.experts.{}.w2.weight"
    return torch.stack([state[per.format(e)] for e in range(config.num_local_experts)])


def quantize(source: Path, path: Path, kind: str = QUANT) -> Path:
    """``source`` (a float32 GGUF) quantized to ``kind`` at ``path`` through ``llama_model_quantize``."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}", None)
    if ftype is None:
        raise MoeprepError(f"llama.cpp has no quantization type {kind!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        raise MoeprepError(f"llama_model_quantize failed on {source}")
    os.replace(tmp, path)
    return path


def prepare_gguf(model_dir: Path, home: Path) -> dict[str, Path]:
    """{"f32": ..., QUANT: ...} GGUF files of the model under ``home`` (reused while newer than the model)."""
    home.mkdir(parents=True, exist_ok=True)
    f32, q4 = home / "model-f32.gguf", home / f"model-{QUANT.lower()}.gguf"
    newest = max(p.stat().st_mtime for p in Path(model_dir).glob("*.safetensors"))
    if not f32.is_file() or f32.stat().st_mtime < newest:
        write_gguf(model_dir, f32)
    if not q4.is_file() or q4.stat().st_mtime < f32.stat().st_mtime:
        quantize(f32, q4)
    return {"f32": f32, QUANT: q4}


def open_model(path: Path, logits_all: bool = False, context: int = 512):
    """llama.cpp on ``path``: 2 threads as the machine has, an f32 KV cache, weight repacking off, mmap."""
    import llama_cpp
    from llama_cpp import llama_cpp as low

    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False  # the repacked weight copy would double the memory
        return p

    low.llama_model_default_params = params
    try:
        threads = max(1, min(os.cpu_count() or 1, 2) if (os.cpu_count() or 1) <= 2 else os.cpu_count())
        return llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                               logits_all=logits_all, type_k=low.GGML_TYPE_F32, type_v=low.GGML_TYPE_F32,
                               use_mmap=True, verbose=False)
    finally:
        low.llama_model_default_params = default


def logit_check(f32: Path, model_dir: Path, prompt_ids: list[int]) -> float:
    """Max |llama.cpp f32 logits - transformers logits| over the prompt's positions."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    llm = open_model(f32, logits_all=True)
    llm.eval(prompt_ids)
    ours = np.array(llm.scores[:len(prompt_ids)])
    llm.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([prompt_ids])).logits[0].numpy()
    return float(np.abs(ours - want).max())


# ------------------------------------------------------------------------------------------ the cgroup


def make_cgroup(name: str, limit_bytes: int) -> Path:
    """A fresh memory cgroup (v1) limited to ``limit_bytes`` (memory and page cache together)."""
    path = CGROUP_ROOT / name
    remove_cgroup(path)
    path.mkdir()
    (path / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
    return path


def join_cgroup(path: Path) -> None:
    """Move this process into the cgroup (what it maps and reads from now on counts against the limit)."""
    (path / "cgroup.procs").write_text(str(os.getpid()))


def cgroup_peak(path: Path) -> int | None:
    try:
        return int((path / "memory.max_usage_in_bytes").read_text())
    except (OSError, ValueError):
        return None


def reset_cgroup_peak(path: Path) -> bool:
    """Start the cgroup's peak over from its usage now (v1: write 0 to memory.max_usage_in_bytes); False if refused."""
    try:
        (path / "memory.max_usage_in_bytes").write_text("0")
    except OSError:
        return False
    return True


def remove_cgroup(path: Path) -> None:
    if path.is_dir():
        try:
            path.rmdir()
        except OSError:
            pass
