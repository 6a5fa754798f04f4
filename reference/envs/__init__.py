"""Reference environments. Each is a package serving the environment checkpoint protocol
through the toolkit (``rollsafe env serve NAME``)."""
