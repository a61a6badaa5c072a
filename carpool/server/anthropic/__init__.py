"""Anthropic's Messages API (`/v1/messages`, count_tokens, Message Batches) on the OpenAI routes' pipeline."""
