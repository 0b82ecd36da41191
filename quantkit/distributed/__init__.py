"""Multi-process quantization through ``torch.distributed`` (torchrun; NCCL on GPUs, gloo on the CPU).

A thin layer: ``comm`` holds the communicator record the walker and the methods take (``LocalComm``,
the single-process no-op default, or ``TorchComm`` over a process group); ``plan`` splits calibration
windows and solves between ranks (pure functions of shapes); ``launch`` starts torchrun and sets the
process group up from its environment.
"""
