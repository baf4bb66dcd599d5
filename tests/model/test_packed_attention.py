"""model/packed_attention.py: packed rows attend within their documents, and the varlen kernel is called
in the keywords of the installed torch.

torch's `varlen_attn` changed its signature between releases (2.10: `is_causal`; 2.11: keyword
`window_size`, no `enable_gqa` keyword; later: `window_size` and `enable_gqa`). Each signature is
stood in for by a CPU function of that signature that computes causal attention document by
document, so the call is checked here against the bucketed SDPA path; tests/test_cuda.py runs the
real kernel. 2.10 may run cuDNN's kernel, which takes no GQA; 2.11's runs FlashAttention 2 only,
which takes fewer k/v heads than q heads without a keyword saying so."""

import pytest
import torch
import torch.nn.functional as F

from model import packed_attention, packed_buckets
from model.packed_attention import PackedDocuments, causal_varlen_attn, document_starts
from tests.helpers.tiny_model import packed_rows, tiny_model


def reference(q, k, v, cu, causal, gqa):
    if k.shape[1] != q.shape[1]:
        assert gqa, "this signature's kernel takes as many k/v heads as q heads"
    out = []
    bounds = cu.tolist()
    for start, end in zip(bounds, bounds[1:]):
        qd, kd, vd = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=gqa).transpose(0, 1))
    return torch.cat(out)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return reference(query, key, value, cu_seq_q, is_causal, gqa=False)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    assert key.shape[1] < query.shape[1], "2.11's FlashAttention takes the k/v heads unrepeated"
    return reference(query, key, value, cu_seq_q, window_size == (-1, 0), gqa=True)


def varlen_newer(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False):
    return reference(query, key, value, cu_seq_q, window_size == (-1, 0), gqa=enable_gqa)


@pytest.mark.parametrize("kernel", [varlen_2_10, varlen_2_11, varlen_newer])
def test_varlen_call_fits_each_torch_signature(monkeypatch, kernel):
    _, positions = packed_rows([[5, 9, 3], [12, 4], [20]], row_len=24)
    documents = PackedDocuments(*document_starts(positions), positions.shape)
    batch, length = positions.shape
    torch.manual_seed(0)
    q = torch.randn(batch, 4, length, 8)
    k, v = torch.randn(batch, 2, length, 8), torch.randn(batch, 2, length, 8)
    expected = documents.attend(q, k, v, 0.0)  # the bucketed SDPA path (CPU)
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], 8) for t in (q, k, v)]
    monkeypatch.setattr(packed_attention, "varlen_attn", kernel)
    out = causal_varlen_attn(*flat, documents.cu_seqlens, documents.max_length)
    out = out.view(batch, length, 4, 8).transpose(1, 2)
    assert torch.allclose(out, expected, atol=1e-6)


def test_buckets_repeat_the_kv_heads_where_sdpa_would_run_gqa_in_its_math_kernel(monkeypatch):
    """Where FlashAttention cannot run (float32, a pre-Ampere GPU) SDPA runs GQA only in its math
    kernel: the buckets then hand SDPA each k/v head repeated for its q heads, same output."""
    _, positions = packed_rows([[5, 9, 3], [12, 4], [20]], row_len=24)
    documents = PackedDocuments(*document_starts(positions), positions.shape)
    batch, length = positions.shape
    torch.manual_seed(0)
    q, k, v = torch.randn(batch, 4, length, 8), torch.randn(batch, 2, length, 8), torch.randn(batch, 2, length, 8)
    expected = documents.attend(q, k, v, 0.0)  # SDPA's own GQA (CPU)
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(query, key, value, **options):
        calls.append((key.shape[1], options["enable_gqa"]))
        return sdpa(query, key, value, **options)

    monkeypatch.setattr(packed_attention, "gqa_needs_expanded_heads", lambda q, k, masked: True)
    monkeypatch.setattr(packed_buckets.F, "scaled_dot_product_attention", spy)
    assert torch.allclose(documents.attend(q, k, v, 0.0), expected, atol=1e-6)
    assert calls and set(calls) == {(4, False)}


@torch.library.custom_op("minisft_test::causal_attention_by_document", mutates_args=())
def causal_attention_by_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 cu_seq: torch.Tensor) -> torch.Tensor:
    return reference(query, key, value, cu_seq, causal=True, gqa=True)


@causal_attention_by_document.register_fake
def _(query, key, value, cu_seq):
    return torch.empty_like(query)


def varlen_as_an_op(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
    """The newest signature, computed by a custom op as torch's kernel is (torch_attn::_varlen_attn)."""
    assert window_size == (-1, 0) and enable_gqa
    return torch.ops.minisft_test.causal_attention_by_document(query, key, value, cu_seq_q)


@pytest.mark.parametrize("head_dim, kernel", [(12, False), (16, True), (24, True)])
def test_a_head_size_the_varlen_kernel_does_not_take_runs_the_bucketed_path(monkeypatch, head_dim, kernel):
    """FlashAttention's varlen kernel takes head sizes that are multiples of 8 (SDPA's flash kernel
    pads the others; varlen_attn does not, and would stop the step): where SDPA's flash check says
    yes (bf16 on an sm80+ GPU, stood in for on the CPU) a head size of 12 runs the bucketed SDPA path,
    16 and 24 the kernel, each with the bucketed path's output."""
    calls = []

    def recording_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False):
        calls.append(query.shape[-1])
        return varlen_as_an_op(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                               enable_gqa=enable_gqa)

    monkeypatch.setattr(packed_attention, "varlen_attn", recording_varlen)
    monkeypatch.setattr(packed_attention, "_half_precision_dtype", lambda q: q.dtype)
    monkeypatch.setattr(packed_attention, "_ask_sdpa_flash", lambda *kind: True)
    _, positions = packed_rows([[5, 9, 3], [12, 4], [20]], row_len=24)
    documents = PackedDocuments(*document_starts(positions), positions.shape)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, heads, 24, head_dim, generator=generator).bfloat16() for heads in (4, 2, 2))
    out = documents.attend(q, k, v, 0.0)
    assert calls == ([head_dim] if kernel else [])
    monkeypatch.setattr(packed_attention, "varlen_attn", None)  # the bucketed SDPA path
    torch.testing.assert_close(out, documents.attend(q, k, v, 0.0), rtol=2e-2, atol=2e-2)


def test_the_varlen_path_compiles_without_a_graph_break(monkeypatch):
    """torch.compile of packed rows on a GPU in bf16 (the varlen kernel) is one graph: the path is
    stood in for on the CPU (a custom op for the kernel, a GPU's capability and half precision),
    the rest of the forward is the model's own."""
    from model.loss import loss_positions_of

    monkeypatch.setattr(packed_attention, "varlen_attn", varlen_as_an_op)
    monkeypatch.setattr(packed_attention, "_half_precision_dtype", lambda q: q.dtype)
    monkeypatch.setattr(packed_attention, "_ask_sdpa_flash", lambda *kind: True)
    model = tiny_model().train()  # head_dim 16: a size the kernel takes
    ids, positions = packed_rows([[5, 9, 3], [12, 4], [20]], row_len=24)
    layout = PackedDocuments(*document_starts(positions), positions.shape)
    inputs = dict(position_ids=positions, labels=ids, skip_logits=True, loss_positions=loss_positions_of(ids),
                  packed_layout=layout)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(ids, **inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    kernels = [node for node in explanation.graphs[0].graph.nodes if "causal_attention_by_document" in str(node.target)]
    assert len(kernels) == model.config.num_hidden_layers
    varlen_loss = model(ids, **inputs).loss
    monkeypatch.setattr(packed_attention, "varlen_attn", None)  # the bucketed SDPA path
    assert torch.allclose(varlen_loss, model(ids, **inputs).loss, atol=1e-6)


def test_the_varlen_path_compiles_again_at_most_twice_over_changing_documents(monkeypatch):
    """Packed batches differ in their number of documents (the length of cu_seqlens) and their
    longest document (an int handed to the kernel): after the first graph, dynamo makes both
    symbolic instead of compiling each batch again."""
    from torch._dynamo.testing import CompileCounter

    from model.loss import loss_positions_of

    monkeypatch.setattr(packed_attention, "varlen_attn", varlen_as_an_op)
    monkeypatch.setattr(packed_attention, "_half_precision_dtype", lambda q: q.dtype)
    monkeypatch.setattr(packed_attention, "_ask_sdpa_flash", lambda *kind: True)
    torch._dynamo.reset()
    counter = CompileCounter()
    model = torch.compile(tiny_model().train(), backend=counter)
    layouts = [[[5, 9, 3], [12, 4], [20]], [[24], [7, 7, 7], [1, 2, 3, 4]], [[10, 10], [3, 3, 3, 3, 3], [23]],
               [[2] * 12, [16, 8], [9, 9]], [[24], [24], [24]]]
    frames = []
    for lengths in layouts:
        ids, positions = packed_rows(lengths, row_len=24)
        layout = PackedDocuments(*document_starts(positions), positions.shape)
        model(ids, position_ids=positions, labels=ids, skip_logits=True, loss_positions=loss_positions_of(ids),
              packed_layout=layout)
        frames.append(counter.frame_count)
    assert frames[0] == 1 and frames[-1] - frames[0] <= 2, frames


def attend_and_differentiate(attend, lengths, row_len):
    """attend(q, k, v, layout) on packed rows of these document lengths: (output, q/k/v gradients)."""
    _, positions = packed_rows(lengths, row_len=row_len)
    layout = PackedDocuments(*document_starts(positions), positions.shape)
    generator = torch.Generator().manual_seed(row_len)
    batch, length = positions.shape
    q, k, v = (torch.randn(batch, heads, length, 16, generator=generator).requires_grad_() for heads in (4, 2, 2))
    out = attend(q, k, v, layout)
    out.backward(torch.randn(out.shape, generator=generator, dtype=out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("backend, autocast, expand_heads", [("eager", False, False), ("aot_eager", False, True),
                                                             ("aot_eager", True, False)])
def test_the_bucketed_path_compiles_without_a_graph_break_and_equals_eager(monkeypatch, backend, autocast,
                                                                            expand_heads):
    """Under torch.compile the buckets are one op: layouts of 7, 4, 5 and 3 buckets and two row
    lengths run without a graph break, compiled again only as sizes turn symbolic, and give eager's
    output and q/k/v gradients bit for bit (the op's backward runs eager's ops again): float32,
    bf16 by autocast (cast before the op), GQA kept or its k/v heads repeated."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    monkeypatch.setattr(packed_attention, "gqa_needs_expanded_heads", lambda q, k, masked: expand_heads)

    def attend(q, k, v, layout):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return layout.attend(q, k, v, 0.0)

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(attend, backend=counter)
    layouts = [([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1], [7, 7, 7, 7, 7]], 40),
               ([[40], [40], [3] * 13, [20, 20]], 40),
               ([[5, 9, 3], [12, 4], [20]], 24), ([[1] * 24, [2] * 12, [24]], 24)]
    for lengths, row_len in layouts:
        expected = attend_and_differentiate(attend, lengths, row_len)
        results = attend_and_differentiate(compiled, lengths, row_len)
        assert all(torch.equal(result, value) for result, value in zip(results, expected)), lengths
    assert expected[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    assert dict(counters["graph_break"]) == {}
    assert counter.frame_count <= 3  # the first layout; the buckets' sizes, then the row length, as symbols


def test_the_bucketed_op_gives_its_shapes_on_a_fake_gpu():
    """The op's shapes without running it (torch.compile's tracing), also for CUDA tensors: the
    plan stays on the CPU, the outputs are q's, k's and v's shapes on their device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, positions = packed_rows([[5, 9, 3], [12, 4], [20]], row_len=24)
    layout = PackedDocuments(*document_starts(positions), positions.shape)
    plan = (layout.gather, layout.bucket_shapes, layout.rows)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(72, 4, 16, device="cuda", dtype=torch.bfloat16)
        kv = torch.empty(72, 2, 16, device="cuda", dtype=torch.bfloat16)
        out, logsumexp = packed_buckets.bucketed_attention(q, kv, kv, *plan, True)
        grads = packed_buckets.bucketed_attention_backward(out, q, kv, kv, out, logsumexp, *plan, True)
    assert (out.shape, out.device, out.dtype) == ((72, 4, 16), torch.device("cuda", 0), torch.bfloat16)
    assert [(g.shape, g.device, g.dtype) for g in grads] == [
        ((72, heads, 16), torch.device("cuda", 0), torch.bfloat16) for heads in (4, 2, 2)]


def test_the_bucketed_op_passes_torchs_custom_op_checks():
    """torch.library.opcheck: the schema, the autograd registration, the fake implementation against
    the real one (shapes, strides, dtypes) and AOT autograd with dynamic shapes."""
    _, positions = packed_rows([[5, 9, 3], [12, 4], [20]], row_len=24)
    layout = PackedDocuments(*document_starts(positions), positions.shape)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(72, heads, 16, generator=generator, requires_grad=True) for heads in (4, 2, 2))
    results = torch.library.opcheck(packed_buckets.bucketed_attention,
                                    (q, k, v, layout.gather, layout.bucket_shapes, layout.rows, False))
    assert set(results.values()) == {"SUCCESS"} and len(results) == 4


def test_a_compiled_model_runs_packed_rows_through_the_bucketed_op_in_one_graph():
    """The model's forward on packed rows on the CPU (the bucketed path) is one graph, one op per layer."""
    from model.loss import loss_positions_of

    model = tiny_model().train()
    ids, positions = packed_rows([[5, 9, 3], [12, 4], [20]], row_len=24)
    layout = PackedDocuments(*document_starts(positions), positions.shape)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(ids, position_ids=positions, labels=ids, skip_logits=True,
                                               loss_positions=loss_positions_of(ids), packed_layout=layout)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    ops = [node for node in explanation.graphs[0].graph.nodes if "bucketed_attention" in str(node.target)]
    assert len(ops) == model.config.num_hidden_layers


@pytest.mark.parametrize("flash_attn", [True, False])
def test_packed_row_gives_each_document_its_own_logits(flash_attn):
    model = tiny_model(flash_attn=flash_attn)
    torch.manual_seed(2)
    doc_a, doc_b = torch.randint(3, 97, (6,)), torch.randint(3, 97, (4,))
    row = torch.cat([doc_a, doc_b, torch.zeros(2, dtype=torch.long)]).unsqueeze(0)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0]])
    packed = model(row, position_ids=positions).logits[0]
    assert torch.allclose(packed[:6], model(doc_a.unsqueeze(0)).logits[0], atol=1e-5)
    assert torch.allclose(packed[6:10], model(doc_b.unsqueeze(0)).logits[0], atol=1e-5)


def test_packed_attention_matches_the_dense_document_mask_in_values_and_gradients():
    # Lengths spread over several power-of-two buckets, a row that is one document, pad tails.
    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1], [7, 7, 7, 7, 7]], row_len=40)
    reference, packed = tiny_model(flash_attn=False).train(), tiny_model(flash_attn=True).train()
    assert packed.model.layers[0].self_attn.use_sdpa and not reference.model.layers[0].self_attn.use_sdpa
    results = []
    for model in (reference, packed):
        out = model(ids, position_ids=positions, labels=ids)
        out.loss.backward()
        results.append((out.logits, out.loss, [p.grad for p in model.parameters()]))
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = results
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for ref_grad, grad in zip(ref_grads, grads):
        assert torch.allclose(grad, ref_grad, atol=1e-5)


def test_packed_attention_builds_no_dense_mask_and_pads_a_bucket_at_most_twofold():
    from model.packed_attention import PackedDocuments
    from model.packed_buckets import BUCKETS

    _, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40]], row_len=40)
    layout = PackedDocuments.from_position_ids(positions)
    assert layout.cu_seqlens.tolist() == [0, 1, 3, 6, 15, 32, 37, 38, 39, 40, 80]
    assert layout.max_length == 40
    # (0,1]: the three 1-token pads and the 1-token document; (1,2]; (2,4]; (4,8]; (8,16]; (16,32]; (32,64]
    assert layout.bucket_shapes.shape == (BUCKETS, 2)
    assert {bucket: tuple(shape) for bucket, shape in enumerate(layout.bucket_shapes.tolist()) if shape[0]} == {
        0: (4, 1), 1: (1, 2), 2: (1, 3), 3: (1, 5), 4: (1, 9), 5: (1, 17), 6: (1, 40)}
    assert layout.gather[:4 + 2 + 3 + 5].tolist() == [0, 37, 38, 39, 1, 2, 3, 4, 5, 32, 33, 34, 35, 36]
    rows = layout.rows
    assert len(rows) == 80 and len(set(rows.tolist())) == 80  # one padded-output row per token
    start = 0
    for n, length in layout.bucket_shapes.tolist():
        real = int(((rows >= start) & (rows < start + n * length)).sum())
        assert n * length <= 2 * real
        start += n * length
    assert start == len(layout.gather) == 4 + 2 + 3 + 5 + 9 + 17 + 40


class PinRecorder:
    """Stands in for page-locked memory on a CPU-only torch: `pin_memory()` returns a copy and
    remembers it; copies to `cuda` are recorded (with whether their source was such a copy), not made."""

    def __init__(self, monkeypatch):
        self.pinned, self.copies = set(), []
        real_to = torch.Tensor.to

        def pin_memory(tensor, *args):
            copy = tensor.clone()
            self.pinned.add(copy.data_ptr())
            return copy

        def to(tensor, device=None, *args, **kwargs):
            if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
                self.copies.append((tensor.data_ptr() in self.pinned, kwargs.get("non_blocking", False)))
                return tensor
            return real_to(tensor, device, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor: tensor.data_ptr() in self.pinned)
        monkeypatch.setattr(torch.Tensor, "to", to)


def test_a_loader_with_pin_memory_pins_the_packed_layout(monkeypatch):
    """The DataLoader's pinning thread pins `cu_seqlens` and the buckets' indices with the batch's
    tensors; the values stay."""
    from torch.utils.data._utils.pin_memory import pin_memory

    recorder = PinRecorder(monkeypatch)
    starts, lengths = document_starts(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]))
    layout = PackedDocuments(starts, lengths, (2, 5))
    pinned = pin_memory({"packed_layout": layout})["packed_layout"]
    assert {pinned.cu_seqlens.data_ptr(), pinned.gather.data_ptr(), pinned.rows.data_ptr()} <= recorder.pinned
    assert pinned.cu_seqlens.tolist() == layout.cu_seqlens.tolist() == [0, 3, 5, 7, 10]
    assert (pinned.starts.tolist(), pinned.lengths.tolist(), pinned.shape) == ([0, 3, 5, 7], [3, 2, 2, 3], (2, 5))
    assert pinned.gather.tolist() == layout.gather.tolist() == [3, 4, 5, 6, 0, 1, 2, 7, 8, 9]
    assert pinned.rows.tolist() == layout.rows.tolist() == [4, 5, 6, 0, 1, 2, 3, 7, 8, 9]
    assert pinned.bucket_shapes is layout.bucket_shapes  # read on the host only


def test_every_copy_of_the_layout_to_a_gpu_starts_from_page_locked_memory(monkeypatch):
    """From pageable memory a copy to the GPU may wait for the stream: cu_seqlens, the SDPA
    buckets' indices and the dense mask's document ids are pinned first, and copied asynchronously;
    the buckets' indices only where the bucketed path runs, not with the layout."""
    recorder = PinRecorder(monkeypatch)
    starts, lengths = document_starts(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]))
    on_gpu = PackedDocuments(starts, lengths, (2, 5)).to("cuda")
    assert len(recorder.copies) == 1  # cu_seqlens
    on_gpu.dense()
    assert len(recorder.copies) == 2  # the document ids
    copied, real_to_device = [], packed_buckets.to_device

    def to_a_gpu(tensor, device):  # the bucketed path with q on a GPU (the attention itself runs on the CPU)
        copied.append(tensor)
        return real_to_device(tensor, torch.device("cuda"))

    monkeypatch.setattr(packed_buckets, "to_device", to_a_gpu)
    q, kv = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    packed_buckets.attend_in_buckets(q, kv, kv, on_gpu.gather, on_gpu.bucket_shapes, on_gpu.rows, False)
    assert copied[0] is on_gpu.gather and copied[1] is on_gpu.rows and len(copied) == 2
    assert recorder.copies == [(True, True)] * 4


def test_the_attention_mask_moves_a_layout_given_on_the_cpu_to_the_hidden_states_device(monkeypatch):
    """A caller of the model may build the layout on the CPU (as the collator does) and not move it;
    the varlen kernel reads `cu_seqlens` on the GPU, so the mask takes a copy there (one pinned
    asynchronous copy); a layout already there, on `cuda` or on `cuda:0`, is used as it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model.modeling_minimind import AttentionMask

    recorder = PinRecorder(monkeypatch)
    starts, lengths = document_starts(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]))
    on_cpu = PackedDocuments(starts, lengths, (2, 5))
    gpu = torch.device("cuda", 0)

    def documents(layout):
        return AttentionMask.build(2, 5, 0, None, None, True, gpu, layout).documents

    moved = documents(on_cpu)
    assert (moved.device, on_cpu.device, recorder.copies) == (gpu, torch.device("cpu"), [(True, True)])
    assert moved.cu_seqlens.tolist() == [0, 3, 5, 7, 10]
    assert documents(moved) is moved and len(recorder.copies) == 1
    on_cuda = on_cpu.to("cuda")  # as `model_inputs` moves it for a run on `cuda` (no index)
    assert (on_cuda.device, len(recorder.copies)) == (torch.device("cuda"), 2)
    with FakeTensorMode():
        on_cuda.cu_seqlens = torch.empty(5, dtype=torch.int32, device="cuda")  # where the copy lands: cuda:0
    assert documents(on_cuda) is on_cuda and len(recorder.copies) == 2
