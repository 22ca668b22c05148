-- 0030: header blocks and bodies are stored as they are, not compressed. A queue
-- holds a message for seconds to days, not for years: PostgreSQL's pglz (this
-- build has no lz4) compressed every body over about 2 KB on its insert and
-- decompressed it at every stage's load, for disk that the row gives back when
-- the message is done. Server CPU a row (bench/bodies.py --reps 5): a 10 KB text
-- body 260 µs to insert compressed, 40 stored plainly; 50 KB of text 1 400
-- against 145, its load 160 against 95; a 100 KB base64 attachment, which pglz
-- works through only to keep as it was, 2 030 against 295. The cost is disk
-- while a message waits: text takes 2-3 times the room. Postfix and RabbitMQ
-- keep their queue files uncompressed too. Only rows written from now on are
-- affected.
ALTER TABLE pepsi.workqueue_body
    ALTER COLUMN header SET STORAGE EXTERNAL,
    ALTER COLUMN body SET STORAGE EXTERNAL;
