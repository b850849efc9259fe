"""The end-to-end benchmark (``make bench-e2e``): ddp_ft's trainers against the stock ones."""
