"""What train_full_sft.py's steps call, by concern. At the root, the steps themselves: args.py
(flags), errors.py (every user-error class), model_setup.py, data_setup.py, run_identity.py,
run_logger.py. Each thing with a format or protocol of its own has a folder:

    runtime/      the process: distributed group and device, stop signals, seeds, precision
    checkpoint/   resume state on disk: atomic files, the save-dir layout and lock, .pt and .dcp, one reader
    weights/      model weights: read every format, write and publish, load for inference
    parallel/     DDP and FSDP2 behind one interface
    evaluation/   held-out figures, best-model selection and early stopping
    loop/         the optimizer-step loop, the run's state, LR schedule, per-source losses

Imports point one way: loop -> parallel, weights -> checkpoint, evaluation -> runtime -> errors
(tests/test_layout.py fails on any import cycle).
"""
