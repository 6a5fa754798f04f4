from rollsafe.cli import app

app(prog_name="rollsafe")
