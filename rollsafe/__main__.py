from rollsafe.cli.app import app

app(prog_name="rollsafe")
