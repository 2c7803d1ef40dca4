"""The terminal front end: the typer app and flags (the only typer importers), the rich display (the only rich importer), the chat REPL."""
