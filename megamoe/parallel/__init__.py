"""Expert parallelism: the fused device-side exchange (``fused``: rows sent through symmetric memory from inside
the expert kernels, no host sync; ``workspace``, ``protocol``, ``senders``, ``owner``; ``loopback`` runs it on
virtual ranks of one device) and TorchTitan's all-to-all baseline (``all_to_all``)."""
