"""The on-disk format: chunk frames, packs, manifests, digests, and the walk from state dicts to leaves and back."""
