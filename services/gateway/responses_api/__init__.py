"""OpenAI's Responses API, translated onto the chat path: request bodies (protocol.py) and
answers (answer.py) are pure; routes.py is the only module here speaking HTTP."""
