"""warmboot's wire schema, codec, compatibility rule, CPU probe and event store."""
