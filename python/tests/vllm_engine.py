"""A vLLM engine without a model, for the connector's tests: vLLM's own config, its real
``Scheduler`` (which builds the scheduler-side connector from the module path, as ``vllm
serve`` does), the KV cache tensors made by vLLM's own ``allocate_kv_cache`` (the exact
views a worker hands ``register_kv_caches``), and a worker-side connector driven in the
order vLLM's model runner drives it. The "forward" writes a deterministic KV for every
computed token (a function of the whole prefix, the position, the layer, K or V, the
head and the dimension), so a test can tell byte for byte whether a block holds what
the prompt's own computation would have written.
"""

import hashlib
import os
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

BLOCK = 16
LAYERS = 2
KV_HEADS = 2
HEAD = 16
DTYPE = torch.float16

_model_dir = None


CONFIG = (
    '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,'
    ' "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": %d,'
    ' "head_dim": %d, "num_hidden_layers": %d, "vocab_size": 1000,'
    ' "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "float16",'
    ' "rope_theta": 10000.0}' % (KV_HEADS, HEAD, LAYERS)
)


def model_dir():
    """A tiny Llama config.json (no weights: nothing here runs the model)."""
    global _model_dir
    if _model_dir is None:
        _model_dir = tempfile.mkdtemp(prefix="kvd-vllm-model-")
        with open(os.path.join(_model_dir, "config.json"), "w") as f:
            f.write(CONFIG)
    return _model_dir


def vllm_config(endpoint, role="kv_both", model=None, **extra):
    ktc = KVTransferConfig(
        kv_connector="KvdConnector",
        kv_connector_module_path="kvd.vllm_connector",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"endpoint": endpoint, "model_id": "kvd-test/tiny-llama", **extra},
    )
    ea = EngineArgs(
        model=model or model_dir(),
        skip_tokenizer_init=True,
        block_size=BLOCK,
        max_model_len=512,
        enforce_eager=True,
        dtype="float16",
        enable_prefix_caching=False,
        max_num_batched_tokens=512,
        kv_transfer_config=ktc,
    )
    return ea.create_engine_config()


def kv_cache_config(num_blocks=64, layout=KVCacheLayout.LBNHC, spec=None, groups=None):
    spec = spec or FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=DTYPE)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        layer_stride, block_stride = page * num_blocks, page
    else:
        layer_stride, block_stride = page, page * LAYERS
    tensor = KVCacheTensor(size=page * num_blocks * LAYERS, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=groups or [KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
    )


def expected_kv(tokens, pos, layer):
    """The KV a token's computation writes: [heads, 2*head] of the layer at ``pos``."""
    h = hashlib.blake2b(bytes(str(tokens[: pos + 1]), "ascii") + bytes([layer]), digest_size=8).digest()
    seed = int.from_bytes(h, "little") % (2**31)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand((KV_HEADS, 2 * HEAD), generator=g) * 4 - 2).to(DTYPE)


class Engine:
    """One engine: scheduler + one worker (TP 1) on CPU KV tensors."""

    def __init__(self, endpoint, role="kv_both", num_blocks=64, layout=KVCacheLayout.LBNHC, model=None, **extra):
        from kvd.vllm_connector import KvdConnector

        self.config = vllm_config(endpoint, role, model, **extra)
        self.config.cache_config.kv_cache_layout = layout.name
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.kvcc = kv_cache_config(num_blocks, layout)
        # vLLM's order: the worker's connector and its caches first, then the scheduler.
        self.kv = allocate_kv_cache(self.kvcc, torch.device("cpu"), layout, [BLOCK])
        self.worker = KvdConnector(self.config, KVConnectorRole.WORKER, self.kvcc)
        self.worker.register_kv_caches(self.kv)
        self.workers, self.kvs = [self.worker], [self.kv]
        self.scheduler = Scheduler(self.config, self.kvcc, StructuredOutputManager(self.config), block_size=BLOCK)
        self.sconn = self.scheduler.connector
        self.outputs = {}  # req id -> EngineCoreOutput of the last step that had one
        self.computed_by_forward = {}  # req id -> positions the fake forward computed

    def add(self, rid, prompt, max_tokens=2, kv_transfer_params=None, **kw):
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra, ignore_eos=True)
        req = Request(rid, list(prompt), sp, None, **kw)
        self.scheduler.add_request(req)
        return req

    def block_ids(self, rid):
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def layer_names(self):
        """The layers in the order the forward runs them."""
        return self.kvcc.kv_cache_groups[0].layer_names

    def write(self, rid, toks, positions, layer):
        """What the layer's attention writes for ``positions`` of ``rid``."""
        ids = self.block_ids(rid)
        for pos in positions:
            self.block(ids[pos // BLOCK], layer)[:, pos % BLOCK, :] = expected_kv(toks, pos, layer)

    def block(self, block_id, layer):
        """One block of one layer as [heads, tokens, 2*head] (vLLM's logical view)."""
        return self.kv[self.kvcc.kv_cache_groups[0].layer_names[layer]][block_id]

    def step(self, wait_layers=True, save_layers=True, on_layer=None):
        """One scheduler step and one "forward", layer by layer in the order vLLM's
        attention layers call the connector: ``wait_for_layer_load`` on entry (unless
        ``wait_layers`` is off: a runner that does not wait), the layer's computation
        (``on_layer(so, layer)`` first: what the layer's attention would read), then
        ``save_kv_layer`` on exit (unless ``save_layers`` is off), ``wait_for_save`` at
        the end."""
        so = self.scheduler.schedule()
        workers = getattr(self, "workers", [self.worker])
        kvs = getattr(self, "kvs", [self.kv])
        for w in workers:
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(None)
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        starts.update(zip(c.req_ids, c.num_computed_tokens))
        names = self.layer_names()
        for layer in range(len(names)):
            if wait_layers:
                for w in workers:
                    w.wait_for_layer_load(names[layer])
            if on_layer is not None:
                on_layer(so, layer)
            # The layer's KV of every scheduled token, into its slot.
            for rid, n in so.num_scheduled_tokens.items():
                start = starts[rid]
                toks = list(self.scheduler.requests[rid].all_token_ids)
                self.write(rid, toks, range(start, start + n), layer)
            if save_layers:
                for w, kv in zip(workers, kvs):
                    if names[layer] in kv:  # (a pipeline stage saves its own layers)
                        w.save_kv_layer(names[layer], kv[names[layer]], None)
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            start = starts[rid]
            toks = list(self.scheduler.requests[rid].all_token_ids)
            self.computed_by_forward.setdefault(rid, set()).update(range(start, start + n))
            req_ids.append(rid)
            if start + n >= len(toks):
                nxt = (sum(toks) * 31 + len(toks)) % 1000
                sampled.append([nxt])
            else:
                sampled.append([])
        for w in workers:
            w.wait_for_save()
        # What vLLM's output aggregator does across TP workers: a receive is finished
        # once every worker reported it, failed if any did.
        counts = self.__dict__.setdefault("_recv_counts", {})
        failed_any = self.__dict__.setdefault("_recv_failed", set())
        finished, invalid = set(), set()
        for w in workers:
            res = w.get_transfer_results(so.finished_req_ids)
            failed_any.update(res.failed_recving or ())
            for rid in res.finished_recving or ():
                counts[rid] = counts.get(rid, 0) + 1
                if counts[rid] == len(workers):
                    del counts[rid]
                    finished.add(rid)
            invalid |= w.get_block_ids_with_load_errors()
        failed = {r for r in finished if r in failed_any}
        failed_any -= failed
        out = KVConnectorOutput(
            finished_sending=None,
            finished_recving=finished or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
        )
        for w in workers:
            w.clear_connector_metadata()
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=out,
        )
        outs = self.scheduler.update_from_output(so, mro)
        for eco in outs.values():
            for o in eco.outputs:
                self.outputs[o.request_id] = o
        return so, out

    def run(self, until, steps=200, sleep=0.005):
        import time

        for _ in range(steps):
            so, out = self.step()
            if until(so, out):
                return so, out
            time.sleep(sleep)
        raise AssertionError("the engine did not get there")

    def layer_holds(self, rid, tokens, nblocks, layer):
        """Whether layer ``layer`` of the first ``nblocks`` blocks of ``rid`` holds the
        prompt's own KV (what that layer's attention reads)."""
        ids = self.block_ids(rid)
        for b in range(nblocks):
            got = self.block(ids[b], layer)
            for t in range(BLOCK):
                if not torch.equal(got[:, t, :], expected_kv(tokens, b * BLOCK + t, layer)):
                    return False
        return True

    def check_blocks(self, rid, tokens, nblocks):
        """Every position of the first ``nblocks`` blocks of ``rid`` holds the KV the prompt's
        own computation writes."""
        ids = self.block_ids(rid)
        for b in range(nblocks):
            for layer in range(LAYERS):
                got = self.block(ids[b], layer)
                for t in range(BLOCK):
                    want = expected_kv(tokens, b * BLOCK + t, layer)
                    assert torch.equal(got[:, t, :], want), f"block {b} layer {layer} token {t} differs"

    def close(self):
        for w in getattr(self, "workers", [self.worker]):
            w.shutdown()


class rank:
    """vLLM's TP rank query answers ``r`` (a worker made inside is rank ``r``'s)."""

    def __init__(self, r):
        self.r = r

    def __enter__(self):
        import vllm.distributed.parallel_state as ps

        self.real = ps.get_tensor_model_parallel_rank
        ps.get_tensor_model_parallel_rank = lambda: self.r

    def __exit__(self, *exc):
        import vllm.distributed.parallel_state as ps

        ps.get_tensor_model_parallel_rank = self.real


def rank_workers(config, kvcc, tp, layout):
    """One worker-side connector per TP rank, each over KV tensors of its own made by
    vLLM's ``allocate_kv_cache``, in vLLM's order (the worker's caches first). Returns
    (workers, their KV tensors)."""
    from kvd.vllm_connector import KvdConnector

    workers, kvs = [], []
    for r in range(tp):
        kv = allocate_kv_cache(kvcc, torch.device("cpu"), layout, [BLOCK])
        with rank(r):
            w = KvdConnector(config, KVConnectorRole.WORKER, kvcc)
            w.register_kv_caches(kv)
        workers.append(w)
        kvs.append(kv)
    return workers, kvs


class TPEngine(Engine):
    """An engine of ``tp`` tensor-parallel ranks: one scheduler, one worker per rank over
    its own KV heads (rank ``r`` holds heads ``r*h .. (r+1)*h``), driven as vLLM drives
    them (the same metadata to every worker, receives aggregated across them)."""

    def __init__(self, endpoint, tp, role="kv_both", num_blocks=64, layout=KVCacheLayout.LBNHC, **extra):
        self.tp = tp
        self.heads = KV_HEADS // tp
        self.config = vllm_config(endpoint, role, None, **extra)
        self.config.parallel_config.tensor_parallel_size = tp
        self.config.cache_config.kv_cache_layout = layout.name
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=self.heads, head_size=HEAD, dtype=DTYPE)
        self.kvcc = kv_cache_config(num_blocks, layout, spec=spec)
        self.workers, self.kvs = rank_workers(self.config, self.kvcc, tp, layout)
        self.worker, self.kv = self.workers[0], self.kvs[0]
        self.scheduler = Scheduler(self.config, self.kvcc, StructuredOutputManager(self.config), block_size=BLOCK)
        self.sconn = self.scheduler.connector
        self.outputs = {}
        self.computed_by_forward = {}

    def block_of(self, r, block_id, layer):
        return self.kvs[r][self.kvcc.kv_cache_groups[0].layer_names[layer]][block_id]

    def write(self, rid, toks, positions, layer):
        ids = self.block_ids(rid)
        h = self.heads
        for pos in positions:
            kv = expected_kv(toks, pos, layer)
            for r in range(self.tp):
                self.block_of(r, ids[pos // BLOCK], layer)[:, pos % BLOCK, :] = kv[r * h : (r + 1) * h]

    def check_blocks(self, rid, tokens, nblocks):
        ids = self.block_ids(rid)
        h = self.heads
        for b in range(nblocks):
            for layer in range(LAYERS):
                for t in range(BLOCK):
                    want = expected_kv(tokens, b * BLOCK + t, layer)
                    for r in range(self.tp):
                        got = self.block_of(r, ids[b], layer)[:, t, :]
                        assert torch.equal(got, want[r * h : (r + 1) * h]), f"rank {r} block {b} layer {layer} token {t} differs"


class stage:
    """vLLM's pipeline group answers stage ``s`` (a worker made inside is stage ``s``'s)."""

    def __init__(self, s):
        self.s = s

    def __enter__(self):
        import types

        import vllm.distributed.parallel_state as ps

        self.real = ps.get_pp_group
        ps.get_pp_group = lambda: types.SimpleNamespace(rank_in_group=self.s)

    def __exit__(self, *exc):
        import vllm.distributed.parallel_state as ps

        ps.get_pp_group = self.real


class PPEngine(Engine):
    """An engine of ``pp`` pipeline stages (TP 1): one scheduler, one worker per stage
    over its own layers (vLLM's partition, ``get_pp_indices``), each stage's KV cache
    config naming only its layers as vLLM's does."""

    def __init__(self, endpoint, pp, role="kv_both", num_blocks=64, layout=KVCacheLayout.LBNHC, **extra):
        from kvd.vllm_connector import KvdConnector
        from vllm.distributed.utils import get_pp_indices

        self.config = vllm_config(endpoint, role, None, **extra)
        self.config.parallel_config.pipeline_parallel_size = pp
        self.config.cache_config.kv_cache_layout = layout.name
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=DTYPE)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.workers, self.kvs, self.kvccs = [], [], []
        for s_ in range(pp):
            a, e = get_pp_indices(LAYERS, s_, pp)
            names = self.names[a:e]
            page = spec.page_size_bytes
            tensor = KVCacheTensor(size=page * num_blocks * len(names), layers=names, layer_stride=page * num_blocks, block_stride=page)
            kvcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)])
            kv = allocate_kv_cache(kvcc, torch.device("cpu"), layout, [BLOCK])
            with stage(s_):
                w = KvdConnector(self.config, KVConnectorRole.WORKER, kvcc)
                w.register_kv_caches(kv)
            self.workers.append(w)
            self.kvs.append(kv)
            self.kvccs.append(kvcc)
        self.worker, self.kv, self.kvcc = self.workers[0], self.kvs[0], self.kvccs[0]
        # vLLM's scheduler gets one worker's config (they differ only in layer names).
        self.scheduler = Scheduler(self.config, self.kvcc, StructuredOutputManager(self.config), block_size=BLOCK)
        self.sconn = self.scheduler.connector
        self.outputs = {}
        self.computed_by_forward = {}

    def layer_names(self):
        return self.names

    def block(self, block_id, layer):
        name = self.names[layer]
        return next(kv for kv in self.kvs if name in kv)[name][block_id]


class MMEngine(Engine):
    """An engine serving multimodal prompts (the connector's keys for them): vLLM's
    scheduler given an encoder budget, as a vision-language model's config gives it, and
    a forward whose KV at a position depends on the items placed at or before it (an
    image's embeddings change every later position's KV, as in a real model)."""

    def __init__(self, endpoint, **extra):
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        super().__init__(endpoint, **extra)
        self.scheduler.max_num_encoder_input_tokens = 4096
        self.scheduler.encoder_cache_manager = EncoderCacheManager.create_manager(cache_size=4096, vllm_config=self.config)

    def _items(self, rid, pos):
        req = self.scheduler.requests[rid]
        return [f.identifier for f in (req.mm_features or []) if f.mm_position.offset <= pos]

    def write(self, rid, toks, positions, layer):
        ids = self.block_ids(rid)
        for pos in positions:
            self.block(ids[pos // BLOCK], layer)[:, pos % BLOCK, :] = expected_kv_mm(toks, pos, layer, self._items(rid, pos))

    def check_blocks_mm(self, rid, tokens, nblocks, items_at):
        """As :meth:`check_blocks`, the KV of each position a function of its items too
        (``items_at(pos)``: the identifiers placed at or before ``pos``)."""
        ids = self.block_ids(rid)
        for b in range(nblocks):
            for layer in range(LAYERS):
                got = self.block(ids[b], layer)
                for t in range(BLOCK):
                    pos = b * BLOCK + t
                    assert torch.equal(got[:, t, :], expected_kv_mm(tokens, pos, layer, items_at(pos))), f"block {b} layer {layer} token {t} differs"


def expected_kv_mm(tokens, pos, layer, items):
    """:func:`expected_kv` of a prompt whose items ``items`` (identifiers) sit at or before
    ``pos``: without items it is exactly :func:`expected_kv`."""
    if not items:
        return expected_kv(tokens, pos, layer)
    h = hashlib.blake2b(bytes(str(tokens[: pos + 1]) + "|" + "|".join(items), "utf-8") + bytes([layer]), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h, "little") % (2**31))
    return (torch.rand((KV_HEADS, 2 * HEAD), generator=g) * 4 - 2).to(DTYPE)



_mqa_dir = None


def mqa_model_dir():
    """A tiny Llama config.json with one KV head (MQA, as an MLA model decodes): every TP
    rank holds it, so decode-context parallelism deals its tokens between ranks."""
    global _mqa_dir
    if _mqa_dir is None:
        _mqa_dir = tempfile.mkdtemp(prefix="kvd-vllm-mqa-")
        with open(os.path.join(_mqa_dir, "config.json"), "w") as f:
            f.write(CONFIG.replace('"num_key_value_heads": %d' % KV_HEADS, '"num_key_value_heads": 1'))
    return _mqa_dir


def dcp_place(pos, dcp, interleave):
    """Where vLLM's decode-context parallelism puts token ``pos`` (its slot mapping): the
    scheduler block (``BLOCK * dcp`` tokens), the DCP rank, and the offset in that rank's
    block of the same id (``interleave`` tokens to a rank at a time)."""
    span = BLOCK * dcp
    o = pos % span
    return pos // span, (o // interleave) % dcp, (o // (interleave * dcp)) * interleave + o % interleave


class DCPEngine(Engine):
    """An engine of ``tp`` TP ranks with decode-context parallelism ``dcp`` (vLLM's
    ``decode_context_parallel_size`` and ``cp_kv_cache_interleave_size``) over an MQA model:
    the scheduler's blocks span ``BLOCK * dcp`` tokens, and rank ``r`` holds, in its block
    of the same id, the tokens vLLM deals to DCP rank ``r % dcp``."""

    def __init__(self, endpoint, tp=2, dcp=2, interleave=1, role="kv_both", num_blocks=64, **extra):
        self.tp, self.dcp, self.interleave = tp, dcp, interleave
        extra.setdefault("model_id", "kvd-test/tiny-mqa")
        self.config = vllm_config(endpoint, role, mqa_model_dir(), **extra)
        pc = self.config.parallel_config
        pc.tensor_parallel_size = tp
        pc.decode_context_parallel_size = dcp
        pc.cp_kv_cache_interleave_size = interleave
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD, dtype=DTYPE)
        self.kvcc = kv_cache_config(num_blocks, KVCacheLayout.LBNHC, spec=spec)
        self.workers, self.kvs = rank_workers(self.config, self.kvcc, tp, KVCacheLayout.LBNHC)
        self.worker, self.kv = self.workers[0], self.kvs[0]
        self.scheduler = Scheduler(self.config, self.kvcc, StructuredOutputManager(self.config), block_size=BLOCK * dcp)
        self.sconn = self.scheduler.connector
        self.outputs = {}
        self.computed_by_forward = {}

    def _views(self, ids, pos, layer):
        """Every rank's [heads, 2*head] view of token ``pos``: the ranks of its DCP rank."""
        b, d, off = dcp_place(pos, self.dcp, self.interleave)
        name = self.kvcc.kv_cache_groups[0].layer_names[layer]
        return [self.kvs[r][name][ids[b]][:, off, :] for r in range(self.tp) if r % self.dcp == d]

    def write(self, rid, toks, positions, layer):
        ids = self.block_ids(rid)
        for pos in positions:
            for v in self._views(ids, pos, layer):
                v.copy_(expected_kv(toks, pos, layer)[:1])

    def check_blocks(self, rid, tokens, nblocks):
        """Every token of the first ``nblocks`` scheduler blocks is, on every rank of its
        DCP rank, the KV the prompt's own computation writes."""
        ids = self.block_ids(rid)
        for pos in range(nblocks * BLOCK * self.dcp):
            for layer in range(LAYERS):
                for v in self._views(ids, pos, layer):
                    assert torch.equal(v, expected_kv(tokens, pos, layer)[:1]), f"token {pos} layer {layer} differs"


def first_schedule(e, r):
    """Steps ``e`` until request ``r`` is scheduled (new, or resumed); returns
    (num_computed_tokens, num_scheduled_tokens). Bounded by steps, not time: the pause
    between steps only yields to the connector's threads."""
    for _ in range(400):
        so, _ = e.step()
        for nr in so.scheduled_new_reqs:
            if nr.req_id == r:
                return nr.num_computed_tokens, so.num_scheduled_tokens[r]
        c = so.scheduled_cached_reqs
        for i, x in enumerate(c.req_ids):
            if x == r and x in c.resumed_req_ids:
                return c.num_computed_tokens[i], so.num_scheduled_tokens[r]
        time.sleep(0.005)
    raise AssertionError(f"{r} was never scheduled")
