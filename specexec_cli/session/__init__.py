"""The session layer both front ends share: chat session, loading, planning, options, profiles, notices."""
