"""What is read and written: corpora and tokenizers, stage snapshots, model folders, artifacts, exports."""
