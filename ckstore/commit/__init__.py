"""The commit protocol: stage, hash, claim, write packs, record; one path for one process or many."""
