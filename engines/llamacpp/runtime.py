"""Thin, typed wrappers over llama-cpp-python's low-level (ctypes) API.

ctypes releases the GIL during each C call, so a model thread decoding here does not stall
the event loop.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np

from engines.grammar_bounds import grammar_problem
from engines.interface import EngineError
from engines.llamacpp.kernels import choose_matmul_kernels
from engines.sampling import draw

log = logging.getLogger("appliance.llamacpp")

_init_lock = threading.Lock()
_initialised = False

# llama.cpp's log levels; below WARN is noise for an operator.
_GGML_LOG_LEVEL_WARN = 3


@L.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level >= _GGML_LOG_LEVEL_WARN and level != 5:
        message = text.decode("utf-8", errors="replace").rstrip()
        if message:
            log.warning("llama.cpp: %s", message)


def init_backend() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            L.llama_log_set(_log_callback, ctypes.c_void_p(0))
            L.llama_backend_init()
            _initialised = True


def system_info() -> str:
    init_backend()
    return (L.llama_print_system_info() or b"").decode()


class Model:
    """A loaded GGUF model: weights and vocabulary, shared by the contexts made from it."""

    def __init__(self, path: Path, *, use_extra_buffers: bool = True, vocab_only: bool = False, gpu_layers: int = 0) -> None:
        if not vocab_only:
            choose_matmul_kernels(invariant=not use_extra_buffers)
        init_backend()
        params = L.llama_model_default_params()
        # Repacked weights take other kernels for one row than for many; see docs/architecture.md.
        params.use_extra_bufts = use_extra_buffers
        params.vocab_only = vocab_only  # the vocabulary alone: another engine's grammars and samplers
        # Always said: llama.cpp's default (-1) offloads every layer on a GPU build.
        params.n_gpu_layers = gpu_layers
        self.ptr = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise EngineError(f"llama.cpp could not load model file {path}")
        self.path = path
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.ptr)
        self.n_embd = L.llama_model_n_embd(self.ptr)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        self._controls: dict[str, int] | None = None

    def pooling(self) -> str | None:
        """The pooling the file declares for embeddings (`<arch>.pooling_type`), if any."""
        value = self.meta(f"{self.meta('general.architecture')}.pooling_type")
        return _POOLING_NAMES.get(int(value)) if value is not None and value.lstrip("-").isdigit() else None

    def meta(self, key: str) -> str | None:
        size = 4096
        while True:
            buf = ctypes.create_string_buffer(size)
            n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (L.llama_token * capacity)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    def piece(self, token: int, *, special: bool = False) -> bytes:
        key = (token, special)
        cached = self._piece_cache.get(key)
        if cached is not None:
            return cached
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = L.llama_token_to_piece(self.vocab, token, buf, size, 0, special)
            if n >= 0:
                data = buf.raw[:n]
                self._piece_cache[key] = data
                return data
            size = -n

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t, special=True) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return self.piece(token, special=True).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    def control_tokens(self) -> dict[str, int]:
        """Each control token's text and id: what a chat template writes between turns."""
        if self._controls is None:
            control = L.LLAMA_TOKEN_ATTR_CONTROL
            self._controls = {}
            for token in range(self.n_vocab):
                if L.llama_vocab_get_attr(self.vocab, token) & control:
                    text = self.token_text(token)
                    if text:
                        self._controls.setdefault(text, token)
        return self._controls

    def special_tokens(self) -> dict[str, str]:
        out = {}
        for name, fn in (("bos_token", L.llama_vocab_bos), ("eos_token", L.llama_vocab_eos)):
            token = fn(self.vocab)
            if token >= 0:
                out[name] = self.token_text(token)
        return out

    def close(self) -> None:
        if self.ptr:
            L.llama_model_free(self.ptr)
            self.ptr = None


class Adapter:
    """A LoRA adapter (GGUF) loaded against a model; applied per context with a scale."""

    def __init__(self, model: Model, path: Path) -> None:
        if not path.is_file():
            raise EngineError(f"adapter file not found: {path}")
        self.ptr = L.llama_adapter_lora_init(model.ptr, str(path).encode())
        if not self.ptr:
            raise EngineError(f"llama.cpp could not load {path.name} as a LoRA adapter for {model.path.name} (see the log for why)")
        self.path = path

    def close(self) -> None:
        if self.ptr:
            L.llama_adapter_lora_free(self.ptr)
            self.ptr = None


# llama.cpp's pooling types (llama_pooling_type) by name
_POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
_POOLING_TYPES = {name: value for value, name in _POOLING_NAMES.items()}

# ggml type ids of the KV cache types we offer
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


@dataclass(frozen=True)
class ContextParams:
    """llama.cpp's context parameters as this engine sets them (policy/memory_plan.py's ContextShape is
    what the memory planner knows of a context)."""

    n_seq: int
    n_ctx_per_seq: int
    n_batch: int
    threads: int
    kv_unified: bool
    flash_attn: bool
    kv_type: str = "f16"  # K's type, a KV_TYPES name
    kv_type_v: str | None = None  # V's type; None: the same as K
    embeddings: bool = False
    pooling: str = "mean"  # with embeddings: how a sequence's token states become one vector
    kv_tokens: int = 0  # with kv_unified: the cells all sequences share; 0: n_seq x n_ctx_per_seq


class KvFull(EngineError):
    """llama_decode found no room in the KV cache for the batch; nothing was computed or changed."""


class Context:
    """A llama.cpp context holding `n_seq` independent sequences, one per slot."""

    def __init__(self, model: Model, shape: ContextParams) -> None:
        params = L.llama_context_default_params()
        # A unified cache may hold fewer cells than every sequence at full length (the engine makes room).
        params.n_ctx = shape.kv_tokens if shape.kv_unified and shape.kv_tokens else shape.n_ctx_per_seq * shape.n_seq
        params.n_seq_max = shape.n_seq
        params.n_batch = shape.n_batch
        params.n_ubatch = shape.n_batch
        params.n_threads = shape.threads
        params.n_threads_batch = shape.threads
        params.kv_unified = shape.kv_unified
        params.flash_attn_type = 1 if shape.flash_attn else 0
        params.type_k = KV_TYPES[shape.kv_type]
        params.type_v = KV_TYPES[shape.kv_type_v or shape.kv_type]
        params.no_perf = True
        if shape.embeddings:
            params.embeddings = True
            params.pooling_type = _POOLING_TYPES[shape.pooling]
        self.ptr = L.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise EngineError(f"llama.cpp could not create a context for {model.path} with {shape}")
        self.model = model
        self.shape = shape
        self.memory = L.llama_get_memory(self.ptr)
        self.n_ctx_per_seq = L.llama_n_ctx_seq(self.ptr) if not shape.kv_unified else shape.n_ctx_per_seq
        self.batch = L.llama_batch_init(shape.n_batch, 0, 1)

    def clear_sequence(self, seq: int) -> None:
        L.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def trim_sequence(self, seq: int, keep: int) -> None:
        """Drops the sequence's KV from position `keep` on."""
        if not L.llama_memory_seq_rm(self.memory, seq, keep, -1):
            L.llama_memory_seq_rm(self.memory, seq, -1, -1)
            raise EngineError(f"llama.cpp could not trim sequence {seq} to {keep} tokens")

    def set_adapters(self, adapters: list[tuple[Adapter, float]]) -> None:
        """The LoRA adapters every following decode applies (llama.cpp skips a no-op change)."""
        if not adapters:
            rc = L.llama_set_adapters_lora(self.ptr, None, 0, None)
        else:
            ptrs = (L.llama_adapter_lora_p_ctypes * len(adapters))(*(a.ptr for a, _ in adapters))
            scales = (ctypes.c_float * len(adapters))(*(scale for _, scale in adapters))
            rc = L.llama_set_adapters_lora(self.ptr, ptrs, len(adapters), scales)
        if rc != 0:
            raise EngineError(f"llama.cpp could not apply the adapters (code {rc})")

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Makes `dst` hold the first `length` positions of `src`. In a unified cache the cells
        are shared, not copied; with one stream per sequence llama.cpp copies the whole stream
        (at the next decode) and the tail is trimmed here."""
        L.llama_memory_seq_rm(self.memory, dst, -1, -1)
        if self.shape.kv_unified:
            L.llama_memory_seq_cp(self.memory, src, dst, 0, length)
        else:
            L.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
            self.trim_sequence(dst, length)

    def save_sequence(self, seq: int) -> bytes:
        """The sequence's KV and positions as bytes, for a host-RAM copy."""
        size = L.llama_state_seq_get_size(self.ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data(self.ptr, buf, size, seq)
        if written != size:
            raise EngineError(f"llama.cpp saved {written} of {size} bytes of sequence {seq}")
        return bytes(buf)

    def restore_sequence(self, seq: int, data: bytes) -> None:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if L.llama_state_seq_set_data(self.ptr, buf, len(data), seq) != len(data):
            L.llama_memory_seq_rm(self.memory, seq, -1, -1)
            raise EngineError(f"llama.cpp could not restore a saved sequence into {seq}")

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants_logits), in batch order."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        rc = L.llama_decode(self.ptr, batch)
        if rc == 1:  # llama.cpp places every ubatch before computing any, so nothing changed
            raise KvFull(f"no room in the KV cache for a batch of {len(entries)} tokens")
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}")

    def logits(self, index: int) -> np.ndarray:
        ptr = L.llama_get_logits_ith(self.ptr, index)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def sequence_embedding(self, seq: int) -> np.ndarray:
        ptr = L.llama_get_embeddings_seq(self.ptr, seq)
        if not ptr:
            raise EngineError("llama.cpp returned no embedding for the sequence")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_embd,)).copy()

    def close(self) -> None:
        if self.ptr:
            L.llama_batch_free(self.batch)
            L.llama_free(self.ptr)
            self.ptr = None


_MIN_TEMPERATURE = 1e-30

# llama_token_data: {int32 id; float logit; float p}, 12 bytes, as a numpy record.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class Sampler:
    """A llama.cpp sampler chain for one request: grammar, then top-k, top-p and temperature, then
    a seeded draw (or greedy at temperature 0)."""

    def __init__(self, model: Model, *, temperature: float, top_p: float, seed: int | None, grammar: str | None,
                 top_k: int = 0) -> None:
        # A positive temperature under 1e-30 (1e-40 is a valid one) scales float32 logits past their
        # range, and the draw then came out of NaNs: llama.cpp's chain gave a token the greedy one is
        # not. At 1e-30 every draw is already the greedy token.
        temperature = max(temperature, _MIN_TEMPERATURE) if temperature > 0.0 else temperature
        params = L.llama_sampler_chain_default_params()
        params.no_perf = True
        self.ptr = L.llama_sampler_chain_init(params)
        self._candidates: np.ndarray | None = None  # `pick`'s token data, reused across steps
        # Greedy with nothing to constrain it: the argmax of the logits, which numpy finds in a sixth
        # of the time the chain takes to copy the vocabulary into its candidates (7 against 44 us
        # for 49,152 tokens); llama.cpp's greedy keeps the first of equal maxima, as argmax does.
        self.greedy = temperature <= 0.0 and grammar is None
        # With a temperature and no grammar or top-k: engines/sampling.py's draw, the chain's
        # distribution at a fraction of its cost on a large vocabulary, seeded as the chain would be.
        self._temperature, self._top_p = temperature, top_p
        self._rng = (np.random.default_rng(None if seed is None else seed & 0xFFFFFFFF)
                     if temperature > 0.0 and grammar is None and top_k <= 0 else None)
        try:
            if grammar is not None:
                problem = grammar_problem(grammar)  # llama.cpp's parser recurses without a limit: not past this
                if problem is not None:
                    raise EngineError(f"the grammar was refused: {problem}")
                g = L.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
                if not g:
                    raise EngineError("the grammar could not be parsed")
                L.llama_sampler_chain_add(self.ptr, g)
            if temperature <= 0.0:
                L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_greedy())
            else:
                if top_k > 0:
                    L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_top_k(top_k))
                if top_p < 1.0:
                    L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_top_p(top_p, 1))
                L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_temp(temperature))
                seed_value = L.LLAMA_DEFAULT_SEED if seed is None else seed & 0xFFFFFFFF
                L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_dist(seed_value))
        except Exception:
            self.close()
            raise

    def sample(self, ctx: Context, index: int) -> int:
        if self.greedy or self._rng is not None:
            return self._numpy(ctx.logits(index))
        return L.llama_sampler_sample(self.ptr, ctx.ptr, index)

    def _numpy(self, logits: np.ndarray) -> int:
        """A chain without a grammar or top-k, sampled in numpy (the reasons above)."""
        if self._rng is None:
            return int(np.argmax(logits))
        return draw(logits, temperature=self._temperature, top_p=self._top_p, rng=self._rng)

    def pick(self, logits: np.ndarray) -> int:
        """Samples from logits computed elsewhere (the MLX engine's) with this chain, and advances
        its grammar: the same constraints, seeds and draws as a llama.cpp request."""
        if self.greedy or self._rng is not None:
            return self._numpy(logits)
        n = logits.shape[-1]
        if self._candidates is None or len(self._candidates) != n:
            self._candidates = np.zeros(n, dtype=_TOKEN_DATA)
            self._ids = np.arange(n, dtype=np.int32)
        candidates = self._candidates
        candidates["id"] = self._ids  # the chain sorts in place
        candidates["logit"] = logits.reshape(-1)
        candidates["p"] = 0.0
        array = L.llama_token_data_array(candidates.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n, -1, False)
        L.llama_sampler_apply(self.ptr, ctypes.byref(array))
        if not 0 <= array.selected < array.size:
            raise EngineError("the grammar allows no token here")
        token = int(array.data[array.selected].id)
        L.llama_sampler_accept(self.ptr, token)
        return token

    def close(self) -> None:
        if self.ptr:
            L.llama_sampler_free(self.ptr)
            self.ptr = None
