"""The gloo group beside an NCCL process group: a failure to connect it, once NCCL's group is up,
is its own line naming GLOO_SOCKET_IFNAME (gloo connects through the address the host's name
resolves to; NCCL picks an interface itself, so its group can be up where gloo's cannot)."""

import argparse
import socket

import pytest
import torch
import torch.distributed as dist

from trainer.errors import DistributedError
from trainer.runtime import distributed


def test_a_gloo_group_that_cannot_connect_beside_nccl_names_gloo_socket_ifname(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(RANK="3", WORLD_SIZE="16", LOCAL_RANK="3", LOCAL_WORLD_SIZE="8").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # nothing to wait for: the NCCL group is stubbed
    joined = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: joined.append(kwargs))
    monkeypatch.setattr(distributed, "barrier", lambda device=None: None)

    def gloo_cannot_connect(**kwargs):
        assert kwargs["backend"] == "gloo"
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error. Gloo connectFullMesh failed")

    monkeypatch.setattr(dist, "new_group", gloo_cannot_connect)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    args = argparse.Namespace(device="auto", backend="auto", local_rank=None, world_size=1, dist_timeout=600.0)
    with pytest.raises(DistributedError) as failed:
        distributed.init_distributed(args)
    assert joined and joined[0]["backend"] == "nccl" and joined[0]["device_id"] == torch.device("cuda", 3)
    assert str(failed.value) == (
        "rank 3: the 16 processes joined the nccl process group, but not the gloo group beside it (the loop's host "
        "values) within --dist_timeout 600s (RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no "
        "error. Gloo connectFullMesh failed): gloo connects through the address this host's name resolves to (node-b "
        "resolves to 127.0.1.1, a loopback address); set GLOO_SOCKET_IFNAME to the network interface the nodes reach "
        "each other on (e.g. GLOO_SOCKET_IFNAME=eth0) for every process")
