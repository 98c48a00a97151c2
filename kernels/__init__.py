"""One variant's life, no DB and no HTTP: ops, render, compile, device, verify, bench, profile."""
