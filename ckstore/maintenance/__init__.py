"""Maintenance over the catalog and blob store: retention policies, gc, fsck and du."""
