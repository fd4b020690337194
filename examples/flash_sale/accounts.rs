//! Accounts and transfers: a transfer holds the locks of both accounts at once.
//!
//! Balances live beside the stock: Redis `GET` and `SET` of `flash_sale:account:{id}` on
//! the first node (or a map in process), read and written without atomicity on purpose,
//! so that only the lock on both accounts keeps concurrent transfers from losing money.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use redis::AsyncCommands;
use serde::Deserialize;
use serde_json::json;
use tower_redlock::{Problem, Rejection, Renewal};

use super::{AppState, Store, StoreError, bounded, store_error};
use tower_redlock::LockRequest;

/// The balances of the in-process store (without `REDIS_URLS`).
static BALANCES: LazyLock<Mutex<HashMap<String, i64>>> = LazyLock::new(Mutex::default);

impl Store {
    async fn balance(&self, account: &str) -> Result<Option<i64>, StoreError> {
        match self {
            Store::Memory(_) => Ok(BALANCES.lock().unwrap().get(account).copied()),
            Store::Redis(conn) => {
                let mut conn = conn.clone();
                bounded(conn.get(format!("flash_sale:account:{account}"))).await
            }
            #[cfg(feature = "cluster-async")]
            Store::Cluster(conn) => {
                let mut conn = conn.clone();
                bounded(conn.get(format!("flash_sale:account:{account}"))).await
            }
        }
    }

    async fn set_balance(&self, account: &str, balance: i64) -> Result<(), StoreError> {
        match self {
            Store::Memory(_) => {
                BALANCES.lock().unwrap().insert(account.to_owned(), balance);
                Ok(())
            }
            Store::Redis(conn) => {
                let mut conn = conn.clone();
                bounded(conn.set(format!("flash_sale:account:{account}"), balance)).await
            }
            #[cfg(feature = "cluster-async")]
            Store::Cluster(conn) => {
                let mut conn = conn.clone();
                bounded(conn.set(format!("flash_sale:account:{account}"), balance)).await
            }
        }
    }
}

/// The account routes: `PUT`/`GET /accounts/{account_id}` and `POST /transfers` (locked on
/// both accounts unless `locking` is off).
pub(super) fn routes(locking: bool) -> Router<AppState> {
    let accounts = Router::new().route("/accounts/{account_id}", get(get_account).put(set_account));
    if locking {
        accounts.route("/transfers", post(transfer))
    } else {
        accounts.route("/transfers", post(transfer_unlocked))
    }
}

#[derive(Deserialize)]
struct SetBalance {
    balance: i64,
}

#[derive(Deserialize)]
struct Transfer {
    from: String,
    to: String,
    amount: i64,
}

fn no_account(account: &str) -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        format!("No account {account}; create it with PUT /accounts/{account}."),
    )
    .into_response()
}

fn bad_request(detail: impl Into<String>) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, detail.into())
}

async fn set_account(
    State(app): State<AppState>,
    Path(account): Path<String>,
    body: Result<Json<SetBalance>, JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(body) => body,
        Err(e) => return bad_request(format!("Expected {{\"balance\": N}}: {e}.")).into_response(),
    };
    if body.balance < 0 {
        return bad_request("balance must be 0 or more").into_response();
    }
    match app.store.set_balance(&account, body.balance).await {
        Ok(()) => Json(json!({"account_id": account, "balance": body.balance})).into_response(),
        Err(e) => store_error(e),
    }
}

async fn get_account(State(app): State<AppState>, Path(account): Path<String>) -> Response {
    match app.store.balance(&account).await {
        Ok(Some(balance)) => {
            Json(json!({"account_id": account, "balance": balance})).into_response()
        }
        Ok(None) => no_account(&account),
        Err(e) => store_error(e),
    }
}

/// The transfer's body, checked: 400 unless it is JSON with two different accounts and a
/// positive amount.
fn checked(body: Result<Json<Transfer>, JsonRejection>) -> Result<Transfer, Problem> {
    let Json(transfer) = body.map_err(|e| {
        bad_request(format!(
            "Expected {{\"from\": \"...\", \"to\": \"...\", \"amount\": N}}: {e}."
        ))
    })?;
    if transfer.from == transfer.to {
        return Err(bad_request("from and to must be different accounts"));
    }
    if transfer.amount <= 0 {
        return Err(bad_request("amount must be above 0"));
    }
    Ok(transfer)
}

/// Locks both accounts with one lease (one attempt: 423 with `Retry-After` while either is
/// held), then moves the money under it; the lease is renewed while the work runs and
/// released at the end.
async fn transfer(
    State(app): State<AppState>,
    body: Result<Json<Transfer>, JsonRejection>,
) -> Response {
    let transfer = match checked(body) {
        Ok(transfer) => transfer,
        Err(answer) => return answer.into_response(),
    };
    // Named in any order: the set is sorted, so two opposite transfers cannot deadlock.
    let accounts = [
        format!("account:{}", transfer.from),
        format!("account:{}", transfer.to),
    ];
    let lease = match app.locks.acquire(LockRequest::all(&accounts)).await {
        Ok(lease) => lease,
        Err(e) => return Rejection::from_lock_error(&e, StatusCode::LOCKED).into_response(),
    };
    let locks = app.locks.clone();
    match locks
        .with_lease(lease, Renewal::default(), |_| move_money(app, transfer))
        .await
    {
        Ok(answer) => answer,
        Err(e) => Rejection::from_lock_error(&e, StatusCode::LOCKED).into_response(),
    }
}

async fn transfer_unlocked(
    State(app): State<AppState>,
    body: Result<Json<Transfer>, JsonRejection>,
) -> Response {
    match checked(body) {
        Ok(transfer) => move_money(app, transfer).await,
        Err(answer) => answer.into_response(),
    }
}

/// Read both balances, work, write both: safe only under the lock on both accounts.
async fn move_money(app: AppState, transfer: Transfer) -> Response {
    let Transfer { from, to, amount } = transfer;
    let mut balances = [0; 2];
    for (balance, account) in balances.iter_mut().zip([&from, &to]) {
        *balance = match app.store.balance(account).await {
            Ok(Some(balance)) => balance,
            Ok(None) => return no_account(account),
            Err(e) => return store_error(e),
        };
    }
    let [from_balance, to_balance] = balances;
    tokio::time::sleep(app.work).await;
    if from_balance < amount {
        return Problem::new(
            StatusCode::CONFLICT,
            format!("Account {from} has {from_balance}, less than {amount}."),
        )
        .into_response();
    }
    let (Some(from_after), Some(to_after)) = (
        from_balance.checked_sub(amount),
        to_balance.checked_add(amount),
    ) else {
        return Problem::new(StatusCode::CONFLICT, "The amount overflows a balance.")
            .into_response();
    };
    for (account, balance) in [(&from, from_after), (&to, to_after)] {
        if let Err(e) = app.store.set_balance(account, balance).await {
            return store_error(e);
        }
    }
    Json(json!({
        "amount": amount,
        "from": {"account_id": from, "balance": from_after},
        "to": {"account_id": to, "balance": to_after},
    }))
    .into_response()
}
