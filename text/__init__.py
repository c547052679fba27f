"""Text in: documents from the user's files, hub datasets and the stdlib (`documents`), the held-out split and the
windows every stage reads (`data`), tokenizers and their byte counts (`tokenizer`), hub ids resolved offline first
(`hub`)."""
