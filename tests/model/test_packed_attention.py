"""model/packed_attention.py: the varlen kernel is called in the keywords of the installed torch.

torch's `varlen_attn` changed its signature between releases (2.10: `is_causal`; 2.11: keyword
`window_size`, no GQA; later: `window_size` and `enable_gqa`). Each signature is stood in for by
a CPU function of that signature that computes causal attention document by document, so the
call is checked here against the bucketed SDPA path; tests/test_cuda.py runs the real kernel."""

import pytest
import torch
import torch.nn.functional as F

from model import packed_attention
from model.packed_attention import PackedDocuments, causal_varlen_attn, document_starts
from tests.model.test_model import packed_rows


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
    return reference(query, key, value, cu_seq_q, window_size == (-1, 0), gqa=False)


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
