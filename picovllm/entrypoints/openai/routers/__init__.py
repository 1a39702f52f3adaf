"""The server's routes, one router a concern: completions, chat, tokenize, admin."""
