from kernelmill.cli import app

app()
