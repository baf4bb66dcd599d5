"""Resume checkpoints on disk (never inference weights: those are trainer/weights/), in layers that
import downwards only:

    resume.py       the one reader of both formats; the newest readable checkpoint; architecture check
    single_file.py  step_*.pt          sharded.py  step_*.dcp/ (--fsdp 1, torch.distributed.checkpoint)
    dcp_reading.py  DCP's index and entries read without unpickling arbitrary objects (for sharded.py)
    save_dir.py     the --save_dir layout, its lock, rotation, setting files aside
    shared_dir.py   --save_dir as one directory that every rank sees, where every rank uses it
    files.py        atomic writes, the safe torch reader
"""
