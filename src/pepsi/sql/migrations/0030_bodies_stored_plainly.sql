-- 0030: header blocks and bodies are stored as they are, not compressed. A queue
-- holds a message for seconds to days, not for years: PostgreSQL's pglz (this
-- build has no lz4) compressed every body over about 2 KB on its insert and
-- decompressed it at every stage's load, for disk that the row gives back when
-- the message is done. Server CPU a row, 2 000 rows (bench/bodies.py): a 10 KB
-- text body 220 µs to insert compressed, 35 stored plainly; 50 KB of text 1 670
-- against 170, its load 185 against 90; base64 attachments, which pglz gives up
-- on, the same either way. The cost is disk while a message waits: text takes
-- 2-3 times the room. Postfix and RabbitMQ keep their queue files uncompressed
-- too. Only rows written from now on are affected.
ALTER TABLE pepsi.workqueue_body
    ALTER COLUMN header SET STORAGE EXTERNAL,
    ALTER COLUMN body SET STORAGE EXTERNAL;
